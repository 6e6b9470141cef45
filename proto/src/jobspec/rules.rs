//! [`JobSpec::validate`]: each section's own checks, then the rules that tie sections
//! together ([`JobSpec::check_across_sections`]).

use super::error::{JobSpecError, SpecError};
use super::spec::JobSpec;

/// The longest sequence a preset can take: its `max_position_embeddings` (BERT's 512). A
/// config file's own limit is checked when the coordinator reads it.
const PRESET_MAX_SEQ_LENGTH: usize = 512;

impl JobSpec {
    /// Checks every value against what is allowed: `[data]`, `[model]`, `[train]`,
    /// `[cluster]` and `[diloco]` each on their own, then
    /// [`JobSpec::check_across_sections`].
    ///
    /// # Errors
    /// [`JobSpecError::Invalid`] naming the first offending key, its value and what is allowed.
    pub fn validate(&self, origin: &str) -> Result<(), JobSpecError> {
        self.check_sections().map_err(|e| e.at(origin))
    }

    fn check_sections(&self) -> Result<(), SpecError> {
        self.data.validate()?;
        self.model.validate()?;
        self.train.validate()?;
        self.cluster.validate()?;
        if let Some(diloco) = &self.diloco {
            diloco.validate()?;
        }
        self.check_across_sections()
    }

    /// The rules no one section can check alone:
    /// - with a `model.preset`, `data.max_seq_length` is at most its 512 positions;
    /// - `train.shard_optimizer` is not with `[diloco]`;
    /// - with `[diloco]`, `train.max_steps`, `train.eval_every` and `train.checkpoint_every`
    ///   fall on outer steps (multiples of `diloco.inner_steps`): only there do all workers
    ///   hold the same weights;
    /// - the `[[phase]]` sections against `[data]`, `[model]`, `[train]` and `[diloco]`
    ///   ([`JobSpec::check_phases`]).
    ///
    /// # Errors
    /// The first [`SpecError`], naming the key.
    pub fn check_across_sections(&self) -> Result<(), SpecError> {
        let (d, t) = (&self.data, &self.train);
        if self.model.preset().is_some() && d.max_seq_length > PRESET_MAX_SEQ_LENGTH {
            return Err(SpecError::new(
                "data.max_seq_length",
                d.max_seq_length.to_string(),
                "at most 512 tokens with a model.preset (its max_position_embeddings)",
            ));
        }
        if t.shard_optimizer && self.diloco.is_some() {
            return Err(SpecError::new(
                "train.shard_optimizer",
                "true",
                "not with [diloco] (its workers keep moments of their own: there is nothing \
                 to shard)",
            ));
        }
        if let Some(diloco) = &self.diloco {
            let h = diloco.inner_steps;
            for (key, value) in [
                ("train.max_steps", t.max_steps),
                ("train.eval_every", t.eval_every),
                ("train.checkpoint_every", t.checkpoint_every),
            ] {
                if !value.is_multiple_of(h) {
                    return Err(SpecError::new(
                        key,
                        value.to_string(),
                        format!(
                            "a multiple of diloco.inner_steps = {h} (weights agree only there)"
                        ),
                    ));
                }
            }
        }
        self.check_phases()
    }
}
