//! Optimizers, learning-rate schedules and gradient clipping over the flat parameter buffer.
//!
//! Moments share the parameter layout (`keel_proto::params`), so they checkpoint and restore
//! as flat slices. Everything is generic over f32 (training) and f64 (exactness checks).
//!
//! # Layout
//! - [`Optimizer`]: the trait the trainer drives (step, state for checkpoints).
//! - `adamw`: AdamW (Loshchilov & Hutter 2019), as `torch.optim.AdamW`.
//! - `lamb`: LAMB (You et al. 2019, Algorithm 2).
//! - `schedule`: warmup then linear / polynomial / constant learning rate.
//! - `clip`: global-norm gradient clipping, as `torch.nn.utils.clip_grad_norm_`.
//! - `diloco`: DiLoCo's outer step around either (Douillard et al. 2023).

mod adamw;
mod clip;
mod diloco;
mod lamb;
mod schedule;

pub use adamw::{AdamW, AdamWConfig};
pub use clip::{clip_grad_norm, global_norm};
pub use diloco::{Diloco, DilocoConfig};
pub use lamb::{Lamb, LambConfig};
pub use schedule::{LrSchedule, ScheduleKind};

/// Errors of restoring optimizer state.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A state buffer is missing.
    #[error("optimizer state `{name}` is missing")]
    MissingState {
        /// The state name (e.g. `exp_avg`).
        name: String,
    },
    /// A state buffer has the wrong length.
    #[error("optimizer state `{name}` has {got} elements, the parameter layout {expected}")]
    LengthMismatch {
        /// The state name.
        name: String,
        /// `ParamLayout::total_len()`.
        expected: usize,
        /// Length given.
        got: usize,
    },
}

/// An optimizer over the flat parameter buffer.
pub trait Optimizer<A = f32>: Send {
    /// One update of `params` `[total_len]` from `grads` `[total_len]` with learning rate `lr`.
    fn step(&mut self, params: &mut [A], grads: &[A], lr: A);
    /// Updates taken so far (the `t` of the bias corrections).
    fn steps_taken(&self) -> u64;
    /// Named state buffers, each `[total_len]` in the parameter layout (for checkpoints).
    fn state(&self) -> Vec<(&'static str, &[A])>;
    /// Restores what [`Optimizer::state`] and [`Optimizer::steps_taken`] returned.
    ///
    /// Errors: [`OptimError::MissingState`], [`OptimError::LengthMismatch`].
    fn load_state(&mut self, steps_taken: u64, state: &[(&str, &[A])]) -> Result<(), OptimError>;
    /// The DiLoCo outer optimizer when this is one (the trainer drives its outer steps).
    fn diloco(&mut self) -> Option<&mut Diloco> {
        None
    }
}

/// Copies state buffer `name` from `state` into `dst`.
fn restore<A: Copy>(dst: &mut [A], name: &str, state: &[(&str, &[A])]) -> Result<(), OptimError> {
    let (_, src) =
        state
            .iter()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| OptimError::MissingState {
                name: name.to_string(),
            })?;
    if src.len() != dst.len() {
        return Err(OptimError::LengthMismatch {
            name: name.to_string(),
            expected: dst.len(),
            got: src.len(),
        });
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// The decay flag of each layout entry, as `(range, decay)` pairs.
fn decay_ranges(layout: &keel_proto::params::ParamLayout) -> Vec<(std::ops::Range<usize>, bool)> {
    layout
        .entries()
        .iter()
        .map(|e| (e.range(), e.decay))
        .collect()
}
