//! [`Faults`]: the test-only fault injection of a worker process, made once from its hidden
//! flags (`--fault-nan-at-step`, `--fault-bad-frame-at-step`) and handed, as one value, to the
//! two places that act on it: the training step (a NaN loss) and the ring task (a failed
//! all-reduce). A worker started without those flags has [`Faults::none`], and nothing here
//! changes what it does.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The faults a worker process injects (tests only). Clones share the once-per-process state
/// of the ring fault, so every job of the process sees it fire at most once.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// This worker's loss is NaN at this 0-based step of every job.
    nan_loss_at_step: Option<u64>,
    /// At this 0-based step, once per process, the first all-reduce fails as on a malformed
    /// frame from the left neighbour.
    bad_frame_at_step: Option<u64>,
    /// Whether the ring fault has fired (in this process: shared by clones).
    bad_frame_fired: Arc<AtomicBool>,
}

impl Faults {
    /// No fault injected: what every worker outside the tests runs with.
    pub fn none() -> Faults {
        Faults::default()
    }

    /// The faults of a worker's flags: `nan_loss_at_step` (`--fault-nan-at-step`) and
    /// `bad_frame_at_step` (`--fault-bad-frame-at-step`), 0-based steps.
    pub fn new(nan_loss_at_step: Option<u64>, bad_frame_at_step: Option<u64>) -> Faults {
        Faults {
            nan_loss_at_step,
            bad_frame_at_step,
            bad_frame_fired: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Makes `loss` (this rank's summed loss of `step`, nats) NaN when the NaN fault is set
    /// for `step`, saying so in the log; otherwise leaves it alone.
    pub fn poison_loss(&self, step: u64, loss: &mut f64) {
        if self.nan_loss_at_step == Some(step) {
            tracing::warn!(step, "fault injection: this rank's loss is NaN");
            *loss = f64::NAN;
        }
    }

    /// Whether this all-reduce of `step` must fail as on a malformed frame: true for the first
    /// one asked about at the ring fault's step, once per process; false ever after.
    pub fn bad_frame_now(&self, step: u64) -> bool {
        self.bad_frame_at_step == Some(step) && !self.bad_frame_fired.swap(true, Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_faults_change_nothing() {
        let f = Faults::none();
        let mut loss = 1.5;
        f.poison_loss(0, &mut loss);
        assert_eq!(loss, 1.5);
        assert!(!f.bad_frame_now(0));
    }

    #[test]
    fn the_nan_fault_fires_at_its_step_only() {
        let f = Faults::new(Some(3), None);
        let mut loss = 1.5;
        f.poison_loss(2, &mut loss);
        assert_eq!(loss, 1.5);
        f.poison_loss(3, &mut loss);
        assert!(loss.is_nan());
    }

    #[test]
    fn the_ring_fault_fires_once_across_clones() {
        let f = Faults::new(None, Some(4));
        let job = f.clone();
        assert!(!job.bad_frame_now(3));
        assert!(job.bad_frame_now(4));
        assert!(!job.bad_frame_now(4));
        assert!(!f.bad_frame_now(4), "a later job of the same process");
    }
}
