//! Learning-rate schedules as HF's `get_*_schedule_with_warmup`: linear warmup from 0 over
//! `warmup_steps`, then linear decay to 0 at `total_steps` (BERT, Devlin et al. 2019,
//! appendix A.2), polynomial decay, or constant.

/// The shape after warmup.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScheduleKind {
    /// Linear decay to 0 at `total_steps` (HF: `get_linear_schedule_with_warmup`).
    Linear,
    /// `peak * (1 - progress)^power` (HF: `get_polynomial_decay_schedule_with_warmup`, lr_end 0).
    Poly {
        /// The exponent (1 = linear).
        power: f64,
    },
    /// Stays at the peak (HF: `get_constant_schedule_with_warmup`).
    Constant,
}

/// A learning-rate schedule over optimizer steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Shape after warmup.
    pub kind: ScheduleKind,
    /// Learning rate at the end of warmup.
    pub peak_lr: f64,
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// Steps of the whole run.
    pub total_steps: u64,
}

impl LrSchedule {
    /// The learning rate of the update taken after `step` updates (0-based), as HF's
    /// `LambdaLR` gives it: `peak * step / warmup` during warmup, then the decay.
    pub fn lr(&self, step: u64) -> f32 {
        self.lr_f64(step) as f32
    }

    /// [`LrSchedule::lr`] in f64.
    pub fn lr_f64(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.peak_lr * step as f64 / self.warmup_steps.max(1) as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let left = (self.total_steps.saturating_sub(step) as f64 / span).clamp(0.0, 1.0);
        match self.kind {
            ScheduleKind::Linear => self.peak_lr * left,
            ScheduleKind::Poly { power } => self.peak_lr * left.powf(power),
            ScheduleKind::Constant => self.peak_lr,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_decay() {
        let s = LrSchedule {
            kind: ScheduleKind::Linear,
            peak_lr: 1e-3,
            warmup_steps: 10,
            total_steps: 110,
        };
        assert_eq!(s.lr_f64(0), 0.0);
        assert!((s.lr_f64(5) - 5e-4).abs() < 1e-15);
        assert!((s.lr_f64(10) - 1e-3).abs() < 1e-15);
        assert!((s.lr_f64(60) - 5e-4).abs() < 1e-15);
        assert_eq!(s.lr_f64(110), 0.0);
        assert_eq!(s.lr_f64(500), 0.0);
        let p = LrSchedule {
            kind: ScheduleKind::Poly { power: 2.0 },
            ..s
        };
        assert!((p.lr_f64(60) - 2.5e-4).abs() < 1e-15);
        let c = LrSchedule {
            kind: ScheduleKind::Constant,
            ..s
        };
        assert_eq!(c.lr_f64(1000), 1e-3);
    }
}
