//! [`JobSpec`], the whole job: its sections, how a job file becomes one, and what the rest of
//! Keel asks of it (paths, batch size).

use super::cluster::ClusterSpec;
use super::data::{DataSpec, DataTable, Vocabulary};
use super::error::{JobSpecError, SpecError};
use super::model::{ModelSource, ModelSpec, ModelTable};
use super::phase::PhaseSpec;
use super::train::TrainSpec;
use crate::diloco::DilocoSpec;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The whole job: data, model, training and cluster settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Corpus and vocabulary, sequence building and masking.
    pub data: DataSpec,
    /// Which BERT to train.
    pub model: ModelSpec,
    /// Optimisation settings.
    pub train: TrainSpec,
    /// How many workers the job runs on.
    #[serde(default)]
    pub cluster: ClusterSpec,
    /// Low-communication training (DiLoCo); absent: synchronous data parallelism.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diloco: Option<DilocoSpec>,
    /// Later training phases (`[[phase]]`, BERT's phase 2: `crate::phases`); empty: the job
    /// is one phase.
    #[serde(default, rename = "phase", skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<PhaseSpec>,
}

/// A job file as written: [`JobSpec`]'s tables before the either/or choices are made, so that
/// a file giving both or neither of two keys is refused as an invalid value (naming the key),
/// not as a TOML error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobFile {
    /// `[data]`.
    pub data: DataTable,
    /// `[model]`.
    pub model: ModelTable,
    /// `[train]`.
    pub train: TrainSpec,
    /// `[cluster]`.
    #[serde(default)]
    pub cluster: ClusterSpec,
    /// `[diloco]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diloco: Option<DilocoSpec>,
    /// `[[phase]]`.
    #[serde(default, rename = "phase", skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<PhaseSpec>,
}

impl TryFrom<JobFile> for JobSpec {
    type Error = SpecError;

    /// The job with its choices made (`[data]`'s vocabulary, `[model]`'s source); no value is
    /// checked against its range here ([`JobSpec::validate`] does).
    ///
    /// Errors: the first section giving both or neither of its alternatives.
    fn try_from(f: JobFile) -> Result<Self, SpecError> {
        Ok(JobSpec {
            data: DataSpec::try_from(f.data)?,
            model: ModelSpec::try_from(f.model)?,
            train: f.train,
            cluster: f.cluster,
            diloco: f.diloco,
            phases: f.phases,
        })
    }
}

impl JobSpec {
    /// Reads and validates a job file.
    ///
    /// # Errors
    /// [`JobSpecError::Io`] if unreadable, else as [`JobSpec::from_toml_str`].
    pub fn from_file(path: &Path) -> Result<JobSpec, JobSpecError> {
        let text = std::fs::read_to_string(path).map_err(|source| JobSpecError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        JobSpec::from_toml_str(&text, &path.display().to_string())
    }

    /// Parses and validates job TOML; `origin` names the text in errors (usually the file).
    ///
    /// # Errors
    /// [`JobSpecError::Parse`] for unknown keys, wrong types or missing keys (with line and
    /// key), [`JobSpecError::Invalid`] for both or neither of two alternatives and for values
    /// out of range (see [`JobSpec::validate`]).
    pub fn from_toml_str(text: &str, origin: &str) -> Result<JobSpec, JobSpecError> {
        // toml's message quotes the offending line: only a bounded prefix of it (a 4 MB key).
        let file: JobFile = toml::from_str(text).map_err(|e| JobSpecError::Parse {
            origin: origin.to_string(),
            message: crate::quote::bounded(
                e.to_string().trim_end(),
                crate::quote::MAX_MESSAGE_BYTES,
            ),
        })?;
        let spec = JobSpec::try_from(file).map_err(|e| e.at(origin))?;
        spec.validate(origin)?;
        Ok(spec)
    }

    /// The job as TOML text (what `keel submit` sends; round-trips through [`JobSpec::from_toml_str`]).
    ///
    /// # Errors
    /// [`JobSpecError::Parse`] if serialisation fails (it does not for valid specs).
    pub fn to_toml_string(&self) -> Result<String, JobSpecError> {
        toml::to_string_pretty(self).map_err(|e| JobSpecError::Parse {
            origin: "job".to_string(),
            message: e.to_string(),
        })
    }

    /// Every path the job names on the coordinator's machine besides the corpus entries, with
    /// its dotted key: `data.vocab`, then `model.config` or `model.init_checkpoint`.
    pub fn named_paths(&self) -> Vec<(&'static str, &Path)> {
        let mut out = Vec::new();
        if let Vocabulary::File(path) = &self.data.vocabulary {
            out.push(("data.vocab", path.as_path()));
        }
        match &self.model.source {
            ModelSource::Config(path) => out.push(("model.config", path.as_path())),
            ModelSource::InitCheckpoint(dir) => out.push(("model.init_checkpoint", dir.as_path())),
            ModelSource::Preset(_) => {}
        }
        out
    }

    /// Checks that every path the job names is absolute, corpus entries first: paths are the
    /// coordinator's, and it does not resolve them against its working directory.
    ///
    /// # Errors
    /// [`SpecError`] naming the first relative path's key.
    pub fn check_paths_absolute(&self) -> Result<(), SpecError> {
        let corpus = self
            .data
            .corpus
            .iter()
            .map(|entry| ("data.corpus", Path::new(entry.as_str())));
        for (key, path) in corpus.chain(self.named_paths()) {
            if !path.is_absolute() {
                return Err(SpecError::new(
                    key,
                    format!("{:?}", path.display().to_string()),
                    "a relative path: job paths must be absolute (`keel submit` makes them so \
                     against its own folder; the coordinator does not resolve them against \
                     its working directory)",
                ));
            }
        }
        Ok(())
    }

    /// Makes every relative path in the job (corpus entries, vocab, model config,
    /// init_checkpoint) absolute against `base`.
    pub fn resolve_paths(&mut self, base: &Path) {
        let abs = |p: &mut PathBuf| {
            if !p.is_absolute() {
                *p = base.join(&*p);
            }
        };
        for entry in &mut self.data.corpus {
            let p = Path::new(entry.as_str());
            if !p.is_absolute() {
                *entry = base.join(p).display().to_string();
            }
        }
        if let Vocabulary::File(v) = &mut self.data.vocabulary {
            abs(v);
        }
        match &mut self.model.source {
            ModelSource::Config(c) | ModelSource::InitCheckpoint(c) => abs(c),
            ModelSource::Preset(_) => {}
        }
    }

    /// Global batch size in sequences for `world_size` workers:
    /// `world_size x micro_batch_size x gradient_accumulation_steps`.
    pub fn global_batch(&self, world_size: usize) -> usize {
        world_size * self.train.micro_batch_size * self.train.gradient_accumulation_steps
    }
}
