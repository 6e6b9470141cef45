//! Low-communication training, the `[diloco]` section of a job file (DiLoCo: Douillard et
//! al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models", Algorithm 1).
//!
//! ```toml
//! [diloco]
//! inner_steps = 50             # H: local AdamW/LAMB steps per worker between outer steps
//! outer_learning_rate = 0.7    # the paper's outer SGD learning rate
//! outer_momentum = 0.9         # its Nesterov momentum
//! ```
//!
//! Without the section a job trains synchronously (every step all-reduces the gradient).

use crate::jobspec::SpecError;
use serde::{Deserialize, Serialize};

/// DiLoCo's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DilocoSpec {
    /// H, local optimizer steps per outer step (>= 1). The paper uses 500 for 150M-400M
    /// models; the gradient all-reduce of every step is replaced by one all-reduce of the
    /// parameter change every H steps.
    pub inner_steps: u64,
    /// Outer learning rate (the paper: 0.7).
    #[serde(default = "default_outer_learning_rate")]
    pub outer_learning_rate: f64,
    /// Outer Nesterov momentum, in `[0, 1)` (the paper: 0.9).
    #[serde(default = "default_outer_momentum")]
    pub outer_momentum: f64,
}

fn default_outer_learning_rate() -> f64 {
    0.7
}

fn default_outer_momentum() -> f64 {
    0.9
}

impl DilocoSpec {
    /// Checks the section's own settings. That the job's step counts fall on outer steps is
    /// a rule across sections (`JobSpec::check_across_sections`).
    ///
    /// # Errors
    /// The first [`SpecError`], naming the key.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.inner_steps == 0 {
            return Err(SpecError::new("diloco.inner_steps", "0", "at least 1"));
        }
        if !(self.outer_learning_rate.is_finite() && self.outer_learning_rate > 0.0) {
            return Err(SpecError::new(
                "diloco.outer_learning_rate",
                self.outer_learning_rate.to_string(),
                "a positive number",
            ));
        }
        if !(0.0..1.0).contains(&self.outer_momentum) {
            return Err(SpecError::new(
                "diloco.outer_momentum",
                self.outer_momentum.to_string(),
                "a number in [0, 1)",
            ));
        }
        Ok(())
    }

    /// Whether a round ends once `steps_done` steps are done: the step that completes them
    /// ends with the outer step.
    pub fn ends_round(&self, steps_done: u64) -> bool {
        steps_done.is_multiple_of(self.inner_steps.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(h: u64) -> DilocoSpec {
        DilocoSpec {
            inner_steps: h,
            outer_learning_rate: 0.7,
            outer_momentum: 0.9,
        }
    }

    #[test]
    fn outer_settings_are_checked() {
        assert!(spec(10).validate().is_ok());
        assert_eq!(spec(0).validate().unwrap_err().key, "diloco.inner_steps");
        let mut s = spec(5);
        s.outer_momentum = 1.0;
        assert_eq!(s.validate().unwrap_err().key, "diloco.outer_momentum");
        s.outer_momentum = 0.0;
        s.outer_learning_rate = 0.0;
        assert_eq!(s.validate().unwrap_err().key, "diloco.outer_learning_rate");
    }

    #[test]
    fn defaults_are_the_papers() {
        let s: DilocoSpec = toml::from_str("inner_steps = 50").unwrap();
        assert_eq!(s, spec(50));
        assert!(toml::from_str::<DilocoSpec>("inner_steps = 5\nlr = 1").is_err());
        assert!(s.ends_round(100) && !s.ends_round(101));
    }
}
