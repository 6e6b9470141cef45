//! BERT's training phases in one job: the `[[phase]]` sections of a job file.
//!
//! The BERT paper (section A.2) and NVIDIA's recipe train ~90% of the steps on sequences of
//! 128 tokens with a large batch, then ~10% on 512 tokens, each phase with its own learning
//! rate and warmup. A job file says so like this:
//!
//! ```toml
//! [data]
//! max_seq_length = 128          # phase 1: [data] and [train] as written
//! max_predictions_per_seq = 20
//! [train]
//! max_steps = 1000              # all phases together
//! micro_batch_size = 32
//! learning_rate = 6e-3
//! warmup_steps = 100            # phase 1's schedule runs over steps 0..900
//!
//! [[phase]]                     # phase 2
//! start_step = 900              # its first step (0-based): steps 900..1000
//! max_seq_length = 512
//! max_predictions_per_seq = 80
//! micro_batch_size = 8
//! learning_rate = 4e-3
//! warmup_steps = 20             # its own warmup and decay, over its own 100 steps
//! ```
//!
//! A setting a phase leaves out keeps the previous phase's value. Every phase has its own
//! learning-rate schedule (the job's `train.schedule`: warmup from 0, then decay to 0 at the
//! phase's last step), its own data (the coordinator prepares the corpus once per sequence
//! length, with one vocabulary) and its own global batch: the world size of the job's first
//! generation times the phase's `micro_batch_size x gradient_accumulation_steps`, whatever
//! the world size later (as within one phase). Weights and optimizer moments go on
//! unchanged across a switch; the switch needs no restart and happens at `start_step`
//! exactly, on every rank.

// The `[[phase]]` section is one of the job file's sections, in `jobspec`; named here too
// (`keel_proto::phases::PhaseSpec`) with the rest of the phases.
pub use crate::jobspec::PhaseSpec;

use crate::jobspec::{JobSpec, SpecError};
use std::ops::Range;

/// Role of a later phase's shard among a rank's files, followed by the phase's 1-based
/// number: `shard_phase2`.
pub const SHARD_PHASE_ROLE: &str = "shard_phase";

/// Role of a later phase's held-out set, when its data are its own (another
/// `max_seq_length`), followed by its number: `heldout_phase2`. Without it the phase
/// evaluates on the previous phase's held-out set.
pub const HELDOUT_PHASE_ROLE: &str = "heldout_phase";

impl JobSpec {
    /// Phases in the job: 1 plus the `[[phase]]` sections.
    pub fn phase_count(&self) -> usize {
        1 + self.phases.len()
    }

    /// The steps of phase `p` (0-based), `start..end`; an empty range past the last phase.
    pub fn phase_steps(&self, p: usize) -> Range<u64> {
        let max = self.train.max_steps;
        let start = match p {
            0 => 0,
            _ => self.phases.get(p - 1).map_or(max, |ph| ph.start_step),
        };
        let end = self.phases.get(p).map_or(max, |ph| ph.start_step);
        start.min(max)..end.min(max)
    }

    /// The phase (0-based) that step `step` (0-based) belongs to; the last phase for steps
    /// at or past `train.max_steps`.
    pub fn phase_at(&self, step: u64) -> usize {
        self.phases
            .iter()
            .take_while(|ph| ph.start_step <= step)
            .count()
    }

    /// The job as phase `p` sees it: `[data]` and `[train]` with the phase's settings (each
    /// one the latest given by phases `1..=p`), `train.max_steps` and `train.warmup_steps`
    /// those of the phase's own schedule (its step count and warmup), and no `[[phase]]`.
    /// Phase 0 of a job without phases is the job itself.
    pub fn phase_view(&self, p: usize) -> JobSpec {
        let mut view = self.clone();
        view.phases.clear();
        for ph in self.phases.iter().take(p) {
            let (d, t) = (&mut view.data, &mut view.train);
            d.max_seq_length = ph.max_seq_length.unwrap_or(d.max_seq_length);
            d.max_predictions_per_seq = ph
                .max_predictions_per_seq
                .unwrap_or(d.max_predictions_per_seq);
            t.micro_batch_size = ph.micro_batch_size.unwrap_or(t.micro_batch_size);
            t.gradient_accumulation_steps = ph
                .gradient_accumulation_steps
                .unwrap_or(t.gradient_accumulation_steps);
            t.learning_rate = ph.learning_rate.unwrap_or(t.learning_rate);
            t.warmup_steps = ph.warmup_steps.unwrap_or(t.warmup_steps);
        }
        let steps = self.phase_steps(p);
        view.train.max_steps = steps.end - steps.start;
        view
    }

    /// Every phase's view ([`JobSpec::phase_view`]), in order.
    pub fn phase_views(&self) -> Vec<JobSpec> {
        (0..self.phase_count())
            .map(|p| self.phase_view(p))
            .collect()
    }

    /// Sequences per step of phase `p`, given `first`, the global batch the job's first
    /// generation fixed for phase 0 (its world size `W1` times phase 0's `b x k`): `W1` times
    /// phase `p`'s `b x k`. So a phase's batch, like phase 0's, does not change with the
    /// world size after a recovery.
    pub fn phase_global_batch(&self, p: usize, first: u64) -> u64 {
        if p == 0 {
            return first;
        }
        let per_rank = |s: &JobSpec| {
            (s.train.micro_batch_size as u64) * (s.train.gradient_accumulation_steps as u64)
        };
        let w1 = (first / per_rank(self).max(1)).max(1);
        w1 * per_rank(&self.phase_view(p))
    }

    /// The smallest global batch of any phase (a world larger than it leaves a rank without
    /// rows), given phase 0's `first`.
    pub fn smallest_global_batch(&self, first: u64) -> u64 {
        (0..self.phase_count())
            .map(|p| self.phase_global_batch(p, first))
            .min()
            .unwrap_or(first)
    }

    /// The 1-based phase whose section set phase `p`'s (0-based) value of a setting (`set`
    /// tells whether a `[[phase]]` section names it): 1 when none up to `p` does.
    fn set_by(&self, p: usize, set: fn(&PhaseSpec) -> bool) -> usize {
        (0..p.min(self.phases.len()))
            .rev()
            .find(|&i| set(&self.phases[i]))
            .map_or(1, |i| i + 2)
    }

    /// Checks the `[[phase]]` sections: start steps strictly increasing inside
    /// `1..train.max_steps`, each setting in the range its `[data]` or `[train]` key allows,
    /// warmups within their phase, and with `[diloco]` every start on an outer step.
    ///
    /// # Errors
    /// The first [`SpecError`]; its value names the phase (`phase 2: ...`).
    pub fn check_phases(&self) -> Result<(), SpecError> {
        let mut previous = 0u64;
        for (i, ph) in self.phases.iter().enumerate() {
            let n = i + 2;
            let at = |v: String| format!("phase {n}: {v}");
            if ph.start_step <= previous || ph.start_step >= self.train.max_steps {
                return Err(SpecError::new(
                    "phase.start_step",
                    at(ph.start_step.to_string()),
                    format!(
                        "after the previous phase's start ({previous}) and before \
                         train.max_steps ({})",
                        self.train.max_steps
                    ),
                ));
            }
            previous = ph.start_step;
            if let Some(d) = &self.diloco
                && !ph.start_step.is_multiple_of(d.inner_steps.max(1))
            {
                return Err(SpecError::new(
                    "phase.start_step",
                    at(ph.start_step.to_string()),
                    format!(
                        "a multiple of diloco.inner_steps = {} (weights agree only there)",
                        d.inner_steps
                    ),
                ));
            }
        }
        for p in 0..self.phase_count() {
            let view = self.phase_view(p);
            let (d, t) = (&view.data, &view.train);
            // The value, and where it came from when an earlier phase set it.
            let at = |v: String, set: fn(&PhaseSpec) -> bool| match self.set_by(p, set) {
                by if by == p + 1 => format!("phase {}: {v}", p + 1),
                by => format!("phase {}: {v} (inherited from phase {by})", p + 1),
            };
            let max_len = if self.model.preset().is_some() {
                512
            } else {
                8192
            };
            if !(8..=max_len).contains(&d.max_seq_length) {
                return Err(SpecError::new(
                    "phase.max_seq_length",
                    at(d.max_seq_length.to_string(), |ph| {
                        ph.max_seq_length.is_some()
                    }),
                    format!("between 8 and {max_len} tokens"),
                ));
            }
            if d.max_predictions_per_seq == 0 || d.max_predictions_per_seq > d.max_seq_length {
                return Err(SpecError::new(
                    "phase.max_predictions_per_seq",
                    at(d.max_predictions_per_seq.to_string(), |ph| {
                        ph.max_predictions_per_seq.is_some()
                    }),
                    "between 1 and the phase's max_seq_length",
                ));
            }
            if !(1..=65_536).contains(&t.micro_batch_size) {
                return Err(SpecError::new(
                    "phase.micro_batch_size",
                    at(t.micro_batch_size.to_string(), |ph| {
                        ph.micro_batch_size.is_some()
                    }),
                    "between 1 and 65536 sequences",
                ));
            }
            if !(1..=65_536).contains(&t.gradient_accumulation_steps) {
                return Err(SpecError::new(
                    "phase.gradient_accumulation_steps",
                    at(t.gradient_accumulation_steps.to_string(), |ph| {
                        ph.gradient_accumulation_steps.is_some()
                    }),
                    "between 1 and 65536",
                ));
            }
            if !(t.learning_rate.is_finite() && t.learning_rate > 0.0 && t.learning_rate < 10.0) {
                return Err(SpecError::new(
                    "phase.learning_rate",
                    at(t.learning_rate.to_string(), |ph| ph.learning_rate.is_some()),
                    "a positive number below 10",
                ));
            }
            if t.warmup_steps > t.max_steps {
                let key = if p == 0 {
                    "train.warmup_steps"
                } else {
                    "phase.warmup_steps"
                };
                return Err(SpecError::new(
                    key,
                    at(t.warmup_steps.to_string(), |ph| ph.warmup_steps.is_some()),
                    format!("at most the phase's {} steps", t.max_steps),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::jobspec::JobSpec;

    const BASE: &str = "[data]\ncorpus = [\"/c.txt\"]\nvocab_size = 1000\nmax_seq_length = 128\n\
        [model]\npreset = \"tiny\"\n[train]\nmicro_batch_size = 8\nmax_steps = 100\n\
        learning_rate = 0.001\nwarmup_steps = 10\n";

    fn spec(phases: &str) -> Result<JobSpec, String> {
        JobSpec::from_toml_str(&format!("{BASE}{phases}"), "job.toml").map_err(|e| e.to_string())
    }

    #[test]
    fn a_job_without_phases_is_one_phase_over_all_steps() {
        let s = spec("").unwrap();
        assert_eq!(s.phase_count(), 1);
        assert_eq!(s.phase_steps(0), 0..100);
        assert_eq!(s.phase_at(99), 0);
        assert_eq!(s.phase_view(0), s);
        assert_eq!(s.phase_global_batch(0, 16), 16);
    }

    #[test]
    fn later_phases_inherit_and_override() {
        let s = spec(
            "[[phase]]\nstart_step = 60\nmax_seq_length = 256\nmicro_batch_size = 2\n\
             warmup_steps = 5\n[[phase]]\nstart_step = 90\nlearning_rate = 0.0005\n",
        )
        .unwrap();
        assert_eq!(s.phase_count(), 3);
        assert_eq!(
            (s.phase_steps(0), s.phase_steps(1), s.phase_steps(2)),
            (0..60, 60..90, 90..100)
        );
        assert_eq!((s.phase_at(59), s.phase_at(60), s.phase_at(95)), (0, 1, 2));
        let v0 = s.phase_view(0);
        assert_eq!((v0.train.max_steps, v0.train.warmup_steps), (60, 10));
        let v2 = s.phase_view(2);
        assert_eq!(v2.data.max_seq_length, 256);
        assert_eq!(v2.train.micro_batch_size, 2);
        assert_eq!(v2.train.warmup_steps, 5);
        assert_eq!(v2.train.learning_rate, 0.0005);
        assert_eq!(v2.train.max_steps, 10);
        assert!(v2.phases.is_empty());
        // First generation of 2 ranks x 8: phase 1's b = 2 gives 2 x 2.
        assert_eq!(s.phase_global_batch(1, 16), 4);
        assert_eq!(s.smallest_global_batch(16), 4);
        // The spec round-trips with its phases.
        let text = s.to_toml_string().unwrap();
        assert_eq!(JobSpec::from_toml_str(&text, "again").unwrap(), s);
    }

    #[test]
    fn bad_phases_are_refused_naming_the_phase() {
        for (phases, key, value) in [
            (
                "[[phase]]\nstart_step = 0\n",
                "phase.start_step",
                "phase 2: 0",
            ),
            (
                "[[phase]]\nstart_step = 100\n",
                "phase.start_step",
                "phase 2: 100",
            ),
            (
                "[[phase]]\nstart_step = 50\n[[phase]]\nstart_step = 40\n",
                "phase.start_step",
                "phase 3: 40",
            ),
            (
                "[[phase]]\nstart_step = 50\nmax_seq_length = 1024\n",
                "phase.max_seq_length",
                "phase 2: 1024",
            ),
            (
                "[[phase]]\nstart_step = 50\nmax_seq_length = 16\n",
                "phase.max_predictions_per_seq",
                "phase 2: 20 (inherited from phase 1)",
            ),
            (
                "[[phase]]\nstart_step = 95\n",
                "phase.warmup_steps",
                "phase 2: 10 (inherited from phase 1)",
            ),
            (
                "[[phase]]\nstart_step = 50\nwarmup_steps = 8\n[[phase]]\nstart_step = 95\n",
                "phase.warmup_steps",
                "phase 3: 8 (inherited from phase 2)",
            ),
            (
                "[[phase]]\nstart_step = 95\nwarmup_steps = 6\n",
                "phase.warmup_steps",
                "phase 2: 6",
            ),
            (
                "[[phase]]\nstart_step = 5\n",
                "train.warmup_steps",
                "phase 1: 10",
            ),
            (
                "[[phase]]\nstart_step = 50\nmicro_batch_size = 0\n",
                "phase.micro_batch_size",
                "phase 2: 0",
            ),
        ] {
            let e = spec(phases).unwrap_err();
            assert!(e.contains(key) && e.contains(value), "{phases}: {e}");
        }
        let unknown = spec("[[phase]]\nstart_step = 50\nmax_seq_len = 256\n").unwrap_err();
        assert!(unknown.contains("max_seq_len"), "{unknown}");
    }

    #[test]
    fn with_diloco_phases_start_on_outer_steps() {
        let d = "[diloco]\ninner_steps = 10\n";
        assert!(spec(&format!("{d}[[phase]]\nstart_step = 50\n")).is_ok());
        let e = spec(&format!("{d}[[phase]]\nstart_step = 55\n")).unwrap_err();
        assert!(e.contains("inner_steps = 10"), "{e}");
    }
}
