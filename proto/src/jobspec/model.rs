//! `[model]`: which BERT to train, from exactly one of a preset, a `config.json` or a
//! checkpoint to continue from: three optional keys in the file, one [`ModelSource`] in the
//! code. [`ModelTable`] is the section as written; [`ModelSpec`] is the section once the
//! choice is made.

use super::error::SpecError;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The presets `[model] preset` accepts.
pub const PRESETS: [&str; 6] = ["tiny", "mini", "small", "medium", "base", "large"];

/// Where the model's architecture (and perhaps its weights) comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// `preset = "NAME"`: one of [`PRESETS`] (vocab_size from the vocabulary).
    Preset(String),
    /// `config = "PATH"`: an HF `config.json`.
    Config(PathBuf),
    /// `init_checkpoint = "DIR"`: an HF checkpoint folder (config.json + model.safetensors)
    /// to continue pretraining.
    InitCheckpoint(PathBuf),
}

/// `[model]`: the architecture's source and the dropout override.
///
/// In TOML and JSON it is the [`ModelTable`] it was read from: the same keys, so job files
/// and stored specs read as before.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "ModelTable", into = "ModelTable")]
pub struct ModelSpec {
    /// `preset`, `config` or `init_checkpoint`.
    pub source: ModelSource,
    /// Override the config's hidden_dropout_prob and attention_probs_dropout_prob.
    pub dropout: Option<f64>,
}

/// `[model]` as written in a job file: exactly one of `preset`, `config`, `init_checkpoint`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelTable {
    /// tiny, mini, small, medium, base or large (vocab_size from the vocabulary).
    #[serde(default)]
    pub preset: Option<String>,
    /// An HF `config.json`.
    #[serde(default)]
    pub config: Option<PathBuf>,
    /// An HF checkpoint folder (config.json + model.safetensors) to continue pretraining.
    #[serde(default)]
    pub init_checkpoint: Option<PathBuf>,
    /// See [`ModelSpec::dropout`].
    #[serde(default)]
    pub dropout: Option<f64>,
}

impl TryFrom<ModelTable> for ModelSpec {
    type Error = SpecError;

    /// The section with its source chosen.
    ///
    /// Errors: not exactly one of `preset`, `config`, `init_checkpoint`.
    fn try_from(t: ModelTable) -> Result<Self, SpecError> {
        let source = match (t.preset, t.config, t.init_checkpoint) {
            (Some(name), None, None) => ModelSource::Preset(name),
            (None, Some(path), None) => ModelSource::Config(path),
            (None, None, Some(dir)) => ModelSource::InitCheckpoint(dir),
            (preset, config, init_checkpoint) => {
                return Err(SpecError::new(
                    "model",
                    format!(
                        "preset={preset:?} config={config:?} init_checkpoint={init_checkpoint:?}"
                    ),
                    "exactly one of model.preset, model.config, model.init_checkpoint",
                ));
            }
        };
        Ok(ModelSpec {
            source,
            dropout: t.dropout,
        })
    }
}

impl From<ModelSpec> for ModelTable {
    fn from(m: ModelSpec) -> Self {
        let (mut preset, mut config, mut init_checkpoint) = (None, None, None);
        match m.source {
            ModelSource::Preset(name) => preset = Some(name),
            ModelSource::Config(path) => config = Some(path),
            ModelSource::InitCheckpoint(dir) => init_checkpoint = Some(dir),
        }
        ModelTable {
            preset,
            config,
            init_checkpoint,
            dropout: m.dropout,
        }
    }
}

impl ModelSpec {
    /// The preset's name, when the model is one (`model.preset`).
    pub fn preset(&self) -> Option<&str> {
        match &self.source {
            ModelSource::Preset(name) => Some(name),
            ModelSource::Config(_) | ModelSource::InitCheckpoint(_) => None,
        }
    }

    /// Checks every `[model]` value on its own.
    ///
    /// Errors: the first [`SpecError`], naming the key.
    pub fn validate(&self) -> Result<(), SpecError> {
        if let ModelSource::Preset(p) = &self.source
            && !PRESETS.contains(&p.as_str())
        {
            return Err(SpecError::new(
                "model.preset",
                format!("{p:?}"),
                format!("one of {}", PRESETS.join(", ")),
            ));
        }
        if let Some(p) = self.dropout
            && !(0.0..1.0).contains(&p)
        {
            return Err(SpecError::new(
                "model.dropout",
                p.to_string(),
                "a probability in [0, 1)",
            ));
        }
        Ok(())
    }
}
