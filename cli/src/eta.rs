//! The time left of a running job, from the pace of its recent steps.
//!
//! indicatif's own ETA divides by the rate since the bar was made: a job that spent two
//! minutes preparing and then did one step looked like a 6-hour job. Here the pace is measured
//! only over steps seen while the job runs, over the last [`WINDOW`] step changes (so a change
//! of pace, a recovery, a slower phase, shows within a few steps), and nothing is estimated
//! until [`MIN_STEPS`] steps have been seen.

use std::collections::VecDeque;

/// Step changes kept: the pace is measured from the oldest to the newest of them.
pub const WINDOW: usize = 20;

/// Steps that must have passed within the window before an estimate is given.
pub const MIN_STEPS: u64 = 3;

/// Observed `(seconds, step)` pairs of a running job, one per step change.
#[derive(Debug, Default)]
pub struct Eta {
    samples: VecDeque<(f64, u64)>,
}

impl Eta {
    /// Records that the job was at `step` at time `seconds` (any fixed origin) while running.
    /// A step lower than the last one (a recovery went back to a checkpoint) starts over.
    pub fn observe(&mut self, seconds: f64, step: u64) {
        match self.samples.back() {
            Some(&(_, last)) if step == last => return,
            Some(&(_, last)) if step < last => self.samples.clear(),
            _ => {}
        }
        self.samples.push_back((seconds, step));
        while self.samples.len() > WINDOW {
            self.samples.pop_front();
        }
    }

    /// Forgets the pace (the job left the running state: preparing again, recovering).
    pub fn reset(&mut self) {
        self.samples.clear();
    }

    /// Seconds left to reach `max_steps` at the window's pace; `None` until at least
    /// [`MIN_STEPS`] steps were seen over a positive time.
    pub fn seconds_left(&self, max_steps: u64) -> Option<f64> {
        let (&(t0, s0), &(t1, s1)) = (self.samples.front()?, self.samples.back()?);
        let steps = s1.saturating_sub(s0);
        let seconds = t1 - t0;
        if steps < MIN_STEPS || seconds <= 0.0 {
            return None;
        }
        Some(max_steps.saturating_sub(s1) as f64 * seconds / steps as f64)
    }
}

/// `ETA 3m 20s`, `ETA 1h 05m`, `ETA 45s`, or `ETA --` when there is no estimate.
pub fn eta_text(seconds: Option<f64>) -> String {
    match seconds {
        Some(s) if s.is_finite() && s >= 0.0 => {
            let s = s.round() as u64;
            if s >= 3600 {
                format!("ETA {}h {:02}m", s / 3600, (s % 3600) / 60)
            } else if s >= 60 {
                format!("ETA {}m {:02}s", s / 60, s % 60)
            } else {
                format!("ETA {s}s")
            }
        }
        _ => "ETA --".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_estimate_until_enough_steps_then_the_recent_pace() {
        let mut eta = Eta::default();
        // A long preparation is not part of the pace: the first sample is the first step.
        eta.observe(120.0, 1);
        assert_eq!(eta.seconds_left(200), None);
        eta.observe(123.0, 2);
        eta.observe(126.0, 3);
        assert_eq!(eta.seconds_left(200), None, "2 steps are too few");
        eta.observe(129.0, 4);
        // 3 steps in 9 s: 3 s a step, 196 steps left.
        let left = eta.seconds_left(200).unwrap();
        assert!((left - 588.0).abs() < 1e-9, "{left}");
        assert_eq!(eta_text(Some(left)), "ETA 9m 48s");
    }

    #[test]
    fn the_window_follows_a_change_of_pace_and_a_step_back_starts_over() {
        let mut eta = Eta::default();
        let mut t = 0.0;
        for step in 1..=30 {
            eta.observe(t, step);
            t += if step < 10 { 10.0 } else { 1.0 };
        }
        // The last 20 changes (steps 11..30) ran at 1 s a step.
        let left = eta.seconds_left(130).unwrap();
        assert!((left - 100.0).abs() < 1e-9, "{left}");
        eta.observe(t, 20);
        assert_eq!(eta.seconds_left(130), None);
        eta.reset();
        assert_eq!(eta.seconds_left(130), None);
    }

    #[test]
    fn eta_text_forms() {
        assert_eq!(eta_text(None), "ETA --");
        assert_eq!(eta_text(Some(f64::NAN)), "ETA --");
        assert_eq!(eta_text(Some(45.2)), "ETA 45s");
        assert_eq!(eta_text(Some(3900.0)), "ETA 1h 05m");
    }
}
