//! The invariants checked at the end of a run, each run's [`Report`] and the [`Summary`] of
//! many runs.

use super::*;
use keel_coordinator::machine::{Outcome, Phase};
use std::fmt;

/// What one seeded run did and found.
#[derive(Debug, Default, Clone)]
pub struct Report {
    /// The run's seed.
    pub seed: u64,
    /// Simulated workers.
    pub workers: usize,
    /// Events taken.
    pub events: u64,
    /// Virtual time at the end, milliseconds.
    pub virtual_ms: u64,
    /// Faults drawn, by kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// Each job's outcome, as a category (`completed`, or the kind of failure).
    pub outcomes: Vec<String>,
    /// Completed jobs whose world size never changed, all compared with an uninterrupted run.
    pub same_world_completed: u64,
    /// Completed jobs whose world size changed (their final weights legitimately differ).
    pub changed_world_completed: u64,
    /// Submissions refused because their first record could not be written (the user
    /// submitted again).
    pub submissions_refused: u64,
    /// Invariant violations, with the virtual time each was seen at (the first 20).
    pub violations: Vec<String>,
    /// Violations beyond the first 20.
    pub more_violations: u64,
}

/// A failed job's reason, named by the fault it comes from; `None` when the reason names no
/// fault the simulation injects (an invariant violation).
fn failure_kind(reason: &str) -> Option<&'static str> {
    [
        ("max_recoveries", "gave up: max_recoveries reached"),
        (
            "min_workers",
            "too few workers within replacement_timeout_seconds",
        ),
        (
            "no final checkpoint",
            "all ranks done but no final checkpoint stored",
        ),
        (
            "preparation was interrupted",
            "preparation interrupted by coordinator crashes",
        ),
    ]
    .into_iter()
    .find(|(needle, _)| reason.contains(needle))
    .map(|(_, kind)| kind)
}

impl Sim {
    /// The end-of-run invariants: every job ended, for a reason that names a fault; a
    /// completed job that kept its world size ends with the uninterrupted run's weights;
    /// every checkpoint the machine counts is stored and holds weights a rank reached at
    /// that step; no worker is left on a finished job.
    pub(super) fn final_checks(&mut self) {
        let Some(mut m) = self.coord.machine.take() else {
            self.violation("the coordinator is down at the end".into());
            return;
        };
        for (i, id) in self.submitted.clone().into_iter().enumerate() {
            let Some(id) = id else {
                self.violation(format!("job {i} was never submitted"));
                continue;
            };
            let Ok(job) = m.job(&id) else {
                let record = if self.coord.records.contains_key(&id) {
                    "not restored"
                } else {
                    "its record was never written"
                };
                self.violation(format!("{id} was accepted and is lost: {record}"));
                self.report.outcomes.push("lost".into());
                continue;
            };
            let outcome = match job.phase() {
                Phase::Finished(Outcome::Completed) => "completed".to_string(),
                Phase::Finished(Outcome::Failed(e)) => {
                    self.trace(|| format!("{id} failed: {e}"));
                    match failure_kind(e) {
                        Some(kind) => kind.to_string(),
                        None => {
                            self.violation(format!("{id} failed for no injected fault: {e}"));
                            "failed: unexplained".to_string()
                        }
                    }
                }
                Phase::Finished(Outcome::Cancelled(e)) => {
                    self.violation(format!("{id} was cancelled, and nobody cancels: {e}"));
                    "cancelled".to_string()
                }
                other => {
                    self.violation(format!(
                        "{id} has not ended by {} ms: {:?} at step {} generation {}",
                        self.now,
                        other.state(),
                        job.step(),
                        job.generation()
                    ));
                    "not ended".to_string()
                }
            };
            let max = job.spec().train.max_steps;
            if outcome == "completed" {
                let stored = self.store.get(&(id.clone(), max)).copied();
                match self.worlds.get(&id).cloned() {
                    Some((worlds, gb)) if worlds.len() == 1 => {
                        let world = *worlds.first().unwrap_or(&1) as u64;
                        let expected = uninterrupted(&id, max, gb, world);
                        if stored != Some(expected) {
                            self.violation(format!(
                                "{id} completed on {world} ranks throughout, but its final \
                                 checkpoint {stored:?} is not the uninterrupted run's {expected}"
                            ));
                        }
                        self.report.same_world_completed += 1;
                    }
                    _ => self.report.changed_world_completed += 1,
                }
            }
            for &step in job.checkpoints() {
                match self.store.get(&(id.clone(), step)).copied() {
                    None if self.pruned.contains(&(id.clone(), step)) => self.violation(format!(
                        "{id}: the machine counts checkpoint {step}, whose folder it removed"
                    )),
                    None => self.violation(format!(
                        "{id}: the machine counts checkpoint {step}, which is not stored"
                    )),
                    Some(w) if !self.reached.contains(&(id.clone(), step, w)) => {
                        self.violation(format!(
                            "{id}: checkpoint {step} holds weights no rank reached at that step"
                        ))
                    }
                    Some(_) => {}
                }
            }
            self.report.outcomes.push(outcome);
        }
        for w in m.workers() {
            if let Some((job, rank)) = w.job()
                && m.job(job).is_ok_and(|j| j.is_finished())
            {
                self.violation(format!(
                    "{} is still attached to finished {job} as rank {rank}",
                    w.describe()
                ));
            }
        }
        for i in 0..self.workers.len() {
            let Some(run) = self.workers[i].run.as_ref().filter(|r| r.training) else {
                continue;
            };
            if m.job(&run.key.job_id).is_ok_and(|j| j.is_finished()) {
                let key = run.key.clone();
                self.violation(format!(
                    "simulated worker {i} still trains finished {} generation {}",
                    key.job_id, key.generation
                ));
            }
        }
        self.baseline_checks(&mut m);
        self.coord.machine = Some(m);
    }

    /// Once every job has ended and the cluster has been quiet for a while, memory and
    /// connections are back at their baseline and memory agrees with the disk:
    /// - the registry holds exactly the live workers' sessions (no entry left of a crashed
    ///   incarnation, a lost session or a worker replaced under the same address);
    /// - no effect waits to be carried out;
    /// - the record on disk of every job says what the machine says (state, generation, step,
    ///   checkpoints, error): a coordinator that restarted now would contradict nothing.
    fn baseline_checks(&mut self, m: &mut Machine) {
        let sessions: BTreeSet<String> = self
            .workers
            .iter()
            .filter(|w| w.alive)
            .filter_map(|w| w.session.as_ref().map(|(id, _)| id.clone()))
            .collect();
        let registered: BTreeSet<String> = m.workers().map(|w| w.id().to_string()).collect();
        for id in registered.difference(&sessions) {
            self.violation(format!(
                "the registry still holds {id}, which no live worker's session names"
            ));
        }
        for id in sessions.difference(&registered) {
            self.violation(format!(
                "a live worker believes it is registered as {id}, which the registry lost"
            ));
        }
        let left = m.take_effects();
        if !left.is_empty() {
            self.violation(format!("{} effects were never carried out", left.len()));
        }
        for job in m.jobs() {
            let now = job.record();
            let id = job.id().to_string();
            match self.coord.records.get(&id) {
                None => self.violation(format!("{id} has no record on disk at the end")),
                Some(disk) => {
                    let seen = |r: &JobRecord| {
                        (
                            r.state.clone(),
                            r.generation,
                            r.step,
                            r.checkpoints.clone(),
                            r.error.clone(),
                        )
                    };
                    if seen(disk) != seen(&now) {
                        self.violation(format!(
                            "{id}: the record on disk {:?} is not what the machine holds {:?}",
                            seen(disk),
                            seen(&now)
                        ));
                    }
                }
            }
        }
    }
}

/// Many runs, summed up.
#[derive(Debug, Default)]
pub struct Summary {
    /// Runs by worker count.
    pub runs: BTreeMap<usize, u64>,
    /// Faults drawn, by kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// Jobs by outcome.
    pub outcomes: BTreeMap<String, u64>,
    /// The first run (seed, workers) that had each outcome.
    pub examples: BTreeMap<String, (u64, usize)>,
    /// Completed jobs compared with an uninterrupted run (same world size throughout).
    pub same_world_completed: u64,
    /// Completed jobs whose world size changed.
    pub changed_world_completed: u64,
    /// Runs with at least one violation: `(seed, workers, first violations)`.
    pub failing: Vec<(u64, usize, Vec<String>)>,
    /// Submissions refused because their first record could not be written.
    pub submissions_refused: u64,
    /// Violations in all.
    pub violations: u64,
    /// Events in all.
    pub events: u64,
    /// The longest run, virtual seconds.
    pub longest_virtual_s: f64,
}

impl Summary {
    /// Adds one run.
    pub fn add(&mut self, r: &Report) {
        *self.runs.entry(r.workers).or_default() += 1;
        for (k, n) in &r.faults {
            *self.faults.entry(*k).or_default() += n;
        }
        for o in &r.outcomes {
            *self.outcomes.entry(o.clone()).or_default() += 1;
            self.examples
                .entry(o.clone())
                .or_insert((r.seed, r.workers));
        }
        self.same_world_completed += r.same_world_completed;
        self.submissions_refused += r.submissions_refused;
        self.changed_world_completed += r.changed_world_completed;
        let n = r.violations.len() as u64 + r.more_violations;
        self.violations += n;
        if n > 0 {
            self.failing.push((r.seed, r.workers, r.violations.clone()));
        }
        self.events += r.events;
        self.longest_virtual_s = self.longest_virtual_s.max(r.virtual_ms as f64 / 1e3);
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let total: u64 = self.runs.values().sum();
        writeln!(f, "runs: {total}")?;
        for (w, n) in &self.runs {
            writeln!(f, "  {w} workers: {n}")?;
        }
        writeln!(f, "faults drawn:")?;
        for (k, n) in &self.faults {
            writeln!(f, "  {k:?}: {n}")?;
        }
        writeln!(f, "jobs:")?;
        for (o, n) in &self.outcomes {
            let (seed, workers) = self.examples.get(o).copied().unwrap_or_default();
            writeln!(f, "  {o}: {n} (first: seed {seed}, {workers} workers)")?;
        }
        writeln!(
            f,
            "completed with one world size (final weights == uninterrupted run): {}; with a \
             changed world size: {}",
            self.same_world_completed, self.changed_world_completed
        )?;
        writeln!(
            f,
            "submissions refused (first record not written; submitted again): {}",
            self.submissions_refused
        )?;
        writeln!(
            f,
            "events: {}; longest run: {:.0} virtual s",
            self.events, self.longest_virtual_s
        )?;
        writeln!(
            f,
            "invariant violations: {} in {} runs",
            self.violations,
            self.failing.len()
        )?;
        for (seed, workers, v) in self.failing.iter().take(20) {
            writeln!(f, "  seed {seed} ({workers} workers):")?;
            for line in v.iter().take(5) {
                writeln!(f, "    {line}")?;
            }
        }
        Ok(())
    }
}
