//! The job file: what a user submits (`keel submit JOB.toml`, `keel local JOB.toml`).
//!
//! A job file is TOML with four tables, `[data]`, `[model]`, `[train]` and `[cluster]` (and an
//! optional `[diloco]`); names
//! follow BERT's `run_pretraining.py` / `create_pretraining_data.py` and Hugging Face. Unknown
//! keys and bad values are errors that name the key and say what is allowed. Paths in the job
//! are paths on the coordinator's machine; `keel submit` makes relative ones absolute against
//! its own working directory before sending the job ([`JobSpec::resolve_paths`]).
//!
//! ```toml
//! [data]
//! corpus = ["corpora/en-kjv"]           # files, dirs or globs
//! vocab_size = 8000                       # train WordPiece; or: vocab = "vocab.txt"
//! lowercase = true
//! objective = "mlm"                       # or "mlm+nsp"
//! max_seq_length = 128
//! masked_lm_prob = 0.15
//! max_predictions_per_seq = 20
//! heldout_fraction = 0.01
//! [model]
//! preset = "tiny"                         # or config = "config.json", or init_checkpoint = "DIR"
//! [train]
//! micro_batch_size = 16
//! max_steps = 300
//! precision = "auto"                      # or "bf16", "fp32" (see crate::precision)
//! allreduce_dtype = "fp32"                # or "bf16": gradients on the wire
//! bucket_mib = 4                          # gradient bucket, MiB (larger for large worlds)
//! shard_optimizer = false                 # ZeRO stage 1: each rank keeps 1/W of the moments
//! [cluster]
//! min_workers = 2
//! max_workers = 2
//! [diloco]                                # optional: low-communication training
//! inner_steps = 50                        # see crate::diloco
//! [[phase]]                               # optional, repeatable: BERT's phase 2
//! start_step = 900                        # see crate::phases
//! max_seq_length = 512
//! ```

use serde::{Deserialize, Serialize};

use crate::precision::{AllReduceDtype, PrecisionSetting};
use std::path::{Path, PathBuf};

/// A job file that could not be read or is not valid.
#[derive(Debug, thiserror::Error)]
pub enum JobSpecError {
    /// The file could not be read.
    #[error("cannot read job file {path}: {source}")]
    Io {
        /// The job file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The text is not TOML of the expected shape (unknown key, wrong type, missing key).
    /// The message carries toml's line/column and the key.
    #[error("{origin}: {message}")]
    Parse {
        /// File name (or other origin) of the text.
        origin: String,
        /// What toml/serde said, with the key and position.
        message: String,
    },
    /// A key has a value outside what is allowed.
    #[error("{origin}: `{key}` = {value}: {expected}")]
    Invalid {
        /// File name (or other origin) of the text.
        origin: String,
        /// Dotted key, e.g. `train.learning_rate`.
        key: &'static str,
        /// The value given, as written back.
        value: String,
        /// What is allowed.
        expected: String,
    },
}

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
    pub diloco: Option<crate::diloco::DilocoSpec>,
    /// Later training phases (`[[phase]]`, BERT's phase 2: `crate::phases`); empty: the job
    /// is one phase.
    #[serde(default, rename = "phase", skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<PhaseSpec>,
}

/// Training objective (BERT paper, section 3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Objective {
    /// Masked LM only, RoBERTa-style full-sentence packing.
    #[serde(rename = "mlm")]
    Mlm,
    /// Masked LM plus next-sentence prediction, the original BERT instances.
    #[serde(rename = "mlm+nsp")]
    MlmNsp,
}

impl Objective {
    /// The name used in job files and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Objective::Mlm => "mlm",
            Objective::MlmNsp => "mlm+nsp",
        }
    }
}

/// `[data]`: where the text is and how it becomes masked sequences.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    /// Files, directories or globs of UTF-8 text (BERT layout), `.gz`, or `.jsonl` with `text`.
    pub corpus: Vec<String>,
    /// Train a WordPiece vocabulary of this many entries (tokens). Exclusive with `vocab`.
    #[serde(default)]
    pub vocab_size: Option<usize>,
    /// Use this `vocab.txt` or `tokenizer.json` instead of training one.
    #[serde(default)]
    pub vocab: Option<PathBuf>,
    /// Lowercase and strip accents (BERT "uncased").
    #[serde(default = "default_true")]
    pub lowercase: bool,
    /// `mlm` or `mlm+nsp`.
    #[serde(default = "default_objective")]
    pub objective: Objective,
    /// Tokens per sequence, `[CLS]` and `[SEP]` included.
    #[serde(default = "default_max_seq_length")]
    pub max_seq_length: usize,
    /// Fraction of tokens predicted per sequence (BERT: 0.15).
    #[serde(default = "default_masked_lm_prob")]
    pub masked_lm_prob: f64,
    /// Upper bound on predicted tokens per sequence (BERT: 20 at length 128).
    #[serde(default = "default_max_predictions_per_seq")]
    pub max_predictions_per_seq: usize,
    /// Mask all word-pieces of a word together.
    #[serde(default)]
    pub whole_word_masking: bool,
    /// Static masking with this many masks per sequence; 0 = dynamic masking (a fresh mask each epoch).
    #[serde(default)]
    pub dupe_factor: u32,
    /// Fraction of sequences held out for evaluation.
    #[serde(default = "default_heldout_fraction")]
    pub heldout_fraction: f64,
    /// How many shards the prepared corpus is split into (0 = one per worker).
    #[serde(default)]
    pub shards: usize,
}

/// `[model]`: exactly one of `preset`, `config`, `init_checkpoint`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// tiny, mini, small, medium, base or large (vocab_size from the vocabulary).
    #[serde(default)]
    pub preset: Option<String>,
    /// An HF `config.json`.
    #[serde(default)]
    pub config: Option<PathBuf>,
    /// An HF checkpoint folder (config.json + model.safetensors) to continue pretraining.
    #[serde(default)]
    pub init_checkpoint: Option<PathBuf>,
    /// Override the config's hidden_dropout_prob and attention_probs_dropout_prob.
    #[serde(default)]
    pub dropout: Option<f64>,
}

/// Optimizer choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// Adam with decoupled weight decay (Loshchilov & Hutter 2019).
    Adamw,
    /// LAMB (You et al. 2019, Algorithm 2).
    Lamb,
}

/// Learning-rate schedule after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// Linear decay to 0 at `max_steps`.
    Linear,
    /// Polynomial decay (power `poly_power`) to 0 at `max_steps`.
    Poly,
    /// Constant after warmup.
    Constant,
}

/// `[train]`: optimisation settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSpec {
    /// Sequences per micro-batch on each worker.
    pub micro_batch_size: usize,
    /// Micro-batches per step on each worker; global batch = workers x micro_batch_size x this.
    #[serde(default = "default_one")]
    pub gradient_accumulation_steps: usize,
    /// Optimizer steps to run.
    pub max_steps: u64,
    /// `adamw` or `lamb`.
    #[serde(default = "default_optimizer")]
    pub optimizer: OptimizerKind,
    /// Peak learning rate.
    #[serde(default = "default_learning_rate")]
    pub learning_rate: f64,
    /// Steps of linear warmup from 0 to `learning_rate`.
    #[serde(default)]
    pub warmup_steps: u64,
    /// `linear`, `poly` or `constant`.
    #[serde(default = "default_schedule")]
    pub schedule: ScheduleKind,
    /// Power of the `poly` schedule.
    #[serde(default = "default_poly_power")]
    pub poly_power: f64,
    /// Decoupled weight decay, not applied to biases and LayerNorm.
    #[serde(default = "default_weight_decay")]
    pub weight_decay: f64,
    /// Adam beta1.
    #[serde(default = "default_beta1")]
    pub adam_beta1: f64,
    /// Adam beta2.
    #[serde(default = "default_beta2")]
    pub adam_beta2: f64,
    /// Adam epsilon.
    #[serde(default = "default_eps")]
    pub adam_epsilon: f64,
    /// Global-norm gradient clipping; 0 = off.
    #[serde(default = "default_one_f64")]
    pub max_grad_norm: f64,
    /// Seed of initial weights, masking and dropout.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Write a checkpoint every this many steps (0 = only the final one).
    #[serde(default)]
    pub checkpoint_every: u64,
    /// Evaluate on the held-out sequences every this many steps (0 = only at the end).
    #[serde(default)]
    pub eval_every: u64,
    /// Keep this many periodic checkpoints (the final one is always kept).
    #[serde(default = "default_keep_checkpoints")]
    pub keep_checkpoints: usize,
    /// Steps whose loss or gradient is not finite are skipped (no update); after this many
    /// skipped steps the job fails.
    #[serde(default = "default_max_skipped_steps")]
    pub max_skipped_steps: u64,
    /// GEMM arithmetic: `auto` (default), `bf16` or `fp32` (see [`crate::precision`]).
    #[serde(default)]
    pub precision: PrecisionSetting,
    /// How gradients travel on the ring: `fp32` (default) or `bf16`, half the bytes, summed in
    /// fp32 at every hop (see [`AllReduceDtype`]).
    #[serde(default)]
    pub allreduce_dtype: AllReduceDtype,
    /// Gradient bucket size, MiB of fp32 (1 to 1024; default 4): each bucket is one ring
    /// all-reduce, started as soon as backward finishes it. Every bucket pays the ring's
    /// per-hop latency 2 (W - 1) times, so large worlds want larger buckets
    /// (`scripts/scale_model.py`); small ones overlap more of the all-reduce with backward.
    #[serde(default = "default_bucket_mib")]
    pub bucket_mib: usize,
    /// ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO", section 5.1, P_os): each of the W ranks
    /// keeps the optimizer moments of 1/W of the parameters and updates only those. The
    /// gradient all-reduce becomes a reduce-scatter, and the updated weights an all-gather:
    /// the same bytes on the wire, 2/W of the moments' memory and 1/W of the optimizer's time
    /// per rank. Checkpoints gather the moments. A lost worker takes its moments with it, so a
    /// job with this set recovers from its newest checkpoint (as DeepSpeed does), not from
    /// the survivors' memory. Not with `[diloco]`. Default false.
    #[serde(default)]
    pub shard_optimizer: bool,
}

/// `[cluster]`: world size bounds and failure detection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// The job starts once this many workers are free, and fails below it.
    #[serde(default = "default_one")]
    pub min_workers: usize,
    /// At most this many workers take part.
    #[serde(default = "default_one")]
    pub max_workers: usize,
    /// A peer silent for this long (seconds) is declared dead.
    #[serde(default = "default_peer_timeout")]
    pub peer_timeout_seconds: f64,
    /// Times the ring may be re-formed after losing a worker (or the coordinator) before the
    /// job fails; 0 = fail at the first loss.
    #[serde(default = "default_max_recoveries")]
    pub max_recoveries: u64,
    /// After a loss leaves fewer than `min_workers`, wait this long (seconds) for a
    /// replacement before failing the job.
    #[serde(default = "default_replacement_timeout")]
    pub replacement_timeout_seconds: f64,
    /// A running job whose step does not advance for this long (seconds) is stalled: the
    /// coordinator names the workers that have not reported the next step and re-forms the
    /// ring without those it can single out (a recovery, counted against `max_recoveries`),
    /// or fails the job. It must cover the longest gap between two steps: the first step of a
    /// generation (fetching the data, a state broadcast), an evaluation, checkpoint staging.
    #[serde(default = "default_progress_timeout")]
    pub progress_timeout_seconds: f64,
}

/// A phase after the first: what changes at `start_step`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhaseSpec {
    /// The phase's first step (0-based; steps `start_step..` the next phase's start or
    /// `train.max_steps`).
    pub start_step: u64,
    /// Tokens per sequence (`data.max_seq_length` of the phase).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_seq_length: Option<usize>,
    /// Masked positions per sequence at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_predictions_per_seq: Option<usize>,
    /// Sequences per micro-batch on each worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch_size: Option<usize>,
    /// Micro-batches per step on each worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gradient_accumulation_steps: Option<usize>,
    /// Peak learning rate of the phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learning_rate: Option<f64>,
    /// Steps of linear warmup at the phase's start, from 0 to its learning rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<u64>,
}

impl Default for ClusterSpec {
    fn default() -> Self {
        ClusterSpec {
            min_workers: 1,
            max_workers: 1,
            peer_timeout_seconds: default_peer_timeout(),
            max_recoveries: default_max_recoveries(),
            replacement_timeout_seconds: default_replacement_timeout(),
            progress_timeout_seconds: default_progress_timeout(),
        }
    }
}

fn default_true() -> bool {
    true
}
fn default_objective() -> Objective {
    Objective::Mlm
}
fn default_max_seq_length() -> usize {
    128
}
fn default_masked_lm_prob() -> f64 {
    0.15
}
fn default_max_predictions_per_seq() -> usize {
    20
}
fn default_heldout_fraction() -> f64 {
    0.01
}
fn default_one() -> usize {
    1
}
fn default_one_f64() -> f64 {
    1.0
}
fn default_optimizer() -> OptimizerKind {
    OptimizerKind::Adamw
}
fn default_learning_rate() -> f64 {
    1e-4
}
fn default_schedule() -> ScheduleKind {
    ScheduleKind::Linear
}
fn default_poly_power() -> f64 {
    1.0
}
fn default_weight_decay() -> f64 {
    0.01
}
fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_eps() -> f64 {
    1e-6
}
fn default_seed() -> u64 {
    42
}
fn default_keep_checkpoints() -> usize {
    3
}
fn default_peer_timeout() -> f64 {
    30.0
}
fn default_max_recoveries() -> u64 {
    16
}
fn default_replacement_timeout() -> f64 {
    600.0
}
/// Ten minutes: the first step of a large model after fetching its shards over a slow link,
/// or a long evaluation, fits; a job stuck at one step is noticed the same hour.
fn default_progress_timeout() -> f64 {
    600.0
}
fn default_max_skipped_steps() -> u64 {
    10
}
fn default_bucket_mib() -> usize {
    4
}

/// The presets `[model] preset` accepts.
pub const PRESETS: [&str; 6] = ["tiny", "mini", "small", "medium", "base", "large"];

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
    /// key), [`JobSpecError::Invalid`] for values out of range (see [`JobSpec::validate`]).
    pub fn from_toml_str(text: &str, origin: &str) -> Result<JobSpec, JobSpecError> {
        // toml's message quotes the offending line: only a bounded prefix of it (a 4 MB key).
        let spec: JobSpec = toml::from_str(text).map_err(|e| JobSpecError::Parse {
            origin: origin.to_string(),
            message: crate::quote::bounded(
                e.to_string().trim_end(),
                crate::quote::MAX_MESSAGE_BYTES,
            ),
        })?;
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

    /// Makes every relative path in the job (corpus entries, vocab, model config,
    /// init_checkpoint) absolute against `base`.
    pub fn resolve_paths(&mut self, base: &Path) {
        let abs = |p: &Path| {
            if p.is_absolute() {
                p.to_path_buf()
            } else {
                base.join(p)
            }
        };
        for entry in &mut self.data.corpus {
            let p = Path::new(entry.as_str());
            if !p.is_absolute() {
                *entry = base.join(p).display().to_string();
            }
        }
        if let Some(v) = &self.data.vocab {
            self.data.vocab = Some(abs(v));
        }
        if let Some(c) = &self.model.config {
            self.model.config = Some(abs(c));
        }
        if let Some(c) = &self.model.init_checkpoint {
            self.model.init_checkpoint = Some(abs(c));
        }
    }

    /// Global batch size in sequences for `world_size` workers:
    /// `world_size x micro_batch_size x gradient_accumulation_steps`.
    pub fn global_batch(&self, world_size: usize) -> usize {
        world_size * self.train.micro_batch_size * self.train.gradient_accumulation_steps
    }

    /// Checks every value against what is allowed.
    ///
    /// # Errors
    /// [`JobSpecError::Invalid`] naming the first offending key, its value and what is allowed.
    pub fn validate(&self, origin: &str) -> Result<(), JobSpecError> {
        let bad = |key: &'static str, value: String, expected: &str| JobSpecError::Invalid {
            origin: origin.to_string(),
            key,
            value,
            expected: expected.to_string(),
        };
        let d = &self.data;
        if d.corpus.is_empty() {
            return Err(bad(
                "data.corpus",
                "[]".into(),
                "at least one file, directory or glob",
            ));
        }
        match (d.vocab_size, &d.vocab) {
            (Some(_), Some(_)) => {
                return Err(bad(
                    "data.vocab",
                    format!("{:?}", d.vocab),
                    "give either data.vocab_size (train a vocabulary) or data.vocab (use a file), not both",
                ));
            }
            (None, None) => {
                return Err(bad(
                    "data.vocab_size",
                    "(missing)".into(),
                    "give data.vocab_size (train a vocabulary) or data.vocab (a vocab.txt or tokenizer.json)",
                ));
            }
            (Some(n), None) if !(100..=1_000_000).contains(&n) => {
                return Err(bad(
                    "data.vocab_size",
                    n.to_string(),
                    "between 100 and 1000000",
                ));
            }
            _ => {}
        }
        if !(8..=8192).contains(&d.max_seq_length) {
            return Err(bad(
                "data.max_seq_length",
                d.max_seq_length.to_string(),
                "between 8 and 8192 tokens",
            ));
        }
        if !(d.masked_lm_prob > 0.0 && d.masked_lm_prob < 1.0) {
            return Err(bad(
                "data.masked_lm_prob",
                d.masked_lm_prob.to_string(),
                "a probability strictly between 0 and 1 (BERT: 0.15)",
            ));
        }
        if d.max_predictions_per_seq == 0 || d.max_predictions_per_seq > d.max_seq_length {
            return Err(bad(
                "data.max_predictions_per_seq",
                d.max_predictions_per_seq.to_string(),
                "between 1 and data.max_seq_length",
            ));
        }
        if !(0.0..0.5).contains(&d.heldout_fraction) {
            return Err(bad(
                "data.heldout_fraction",
                d.heldout_fraction.to_string(),
                "a fraction in [0, 0.5)",
            ));
        }

        let m = &self.model;
        let given = [
            m.preset.is_some(),
            m.config.is_some(),
            m.init_checkpoint.is_some(),
        ];
        if given.iter().filter(|&&g| g).count() != 1 {
            return Err(bad(
                "model",
                format!(
                    "preset={:?} config={:?} init_checkpoint={:?}",
                    m.preset, m.config, m.init_checkpoint
                ),
                "exactly one of model.preset, model.config, model.init_checkpoint",
            ));
        }
        if let Some(p) = &m.preset
            && !PRESETS.contains(&p.as_str())
        {
            return Err(bad(
                "model.preset",
                format!("{p:?}"),
                &format!("one of {}", PRESETS.join(", ")),
            ));
        }
        // The presets have 512 positions (BERT's max_position_embeddings); a config file's own
        // limit is checked when the coordinator reads it.
        if m.preset.is_some() && d.max_seq_length > 512 {
            return Err(bad(
                "data.max_seq_length",
                d.max_seq_length.to_string(),
                "at most 512 tokens with a model.preset (its max_position_embeddings)",
            ));
        }
        if let Some(p) = m.dropout
            && !(0.0..1.0).contains(&p)
        {
            return Err(bad(
                "model.dropout",
                p.to_string(),
                "a probability in [0, 1)",
            ));
        }

        let t = &self.train;
        if t.micro_batch_size == 0 || t.micro_batch_size > 65_536 {
            return Err(bad(
                "train.micro_batch_size",
                t.micro_batch_size.to_string(),
                "between 1 and 65536 sequences",
            ));
        }
        if t.gradient_accumulation_steps == 0 || t.gradient_accumulation_steps > 65_536 {
            return Err(bad(
                "train.gradient_accumulation_steps",
                t.gradient_accumulation_steps.to_string(),
                "between 1 and 65536",
            ));
        }
        if t.max_steps == 0 {
            return Err(bad("train.max_steps", "0".into(), "at least 1 step"));
        }
        if !(t.learning_rate.is_finite() && t.learning_rate > 0.0 && t.learning_rate < 10.0) {
            return Err(bad(
                "train.learning_rate",
                t.learning_rate.to_string(),
                "a positive number below 10",
            ));
        }
        if t.warmup_steps > t.max_steps {
            return Err(bad(
                "train.warmup_steps",
                t.warmup_steps.to_string(),
                "at most train.max_steps",
            ));
        }
        if !(t.poly_power.is_finite() && t.poly_power > 0.0) {
            return Err(bad(
                "train.poly_power",
                t.poly_power.to_string(),
                "a positive number",
            ));
        }
        if !(t.weight_decay.is_finite() && (0.0..1.0).contains(&t.weight_decay)) {
            return Err(bad(
                "train.weight_decay",
                t.weight_decay.to_string(),
                "a number in [0, 1)",
            ));
        }
        for (key, v) in [
            ("train.adam_beta1", t.adam_beta1),
            ("train.adam_beta2", t.adam_beta2),
        ] {
            if !(0.0..1.0).contains(&v) {
                return Err(bad(key, v.to_string(), "a number in [0, 1)"));
            }
        }
        if !(t.adam_epsilon.is_finite() && t.adam_epsilon > 0.0) {
            return Err(bad(
                "train.adam_epsilon",
                t.adam_epsilon.to_string(),
                "a positive number",
            ));
        }
        if !(t.max_grad_norm.is_finite() && t.max_grad_norm >= 0.0) {
            return Err(bad(
                "train.max_grad_norm",
                t.max_grad_norm.to_string(),
                "a number >= 0 (0 turns clipping off)",
            ));
        }
        if t.keep_checkpoints == 0 {
            return Err(bad(
                "train.keep_checkpoints",
                "0".into(),
                "at least 1 checkpoint",
            ));
        }
        if !(1..=1024).contains(&t.bucket_mib) {
            return Err(bad(
                "train.bucket_mib",
                t.bucket_mib.to_string(),
                "1 to 1024 MiB",
            ));
        }

        if t.shard_optimizer && self.diloco.is_some() {
            return Err(bad(
                "train.shard_optimizer",
                "true".into(),
                "not with [diloco] (its workers keep moments of their own: there is nothing \
                 to shard)",
            ));
        }
        if let Some(diloco) = &self.diloco {
            diloco
                .check(t.max_steps, t.eval_every, t.checkpoint_every)
                .map_err(|(key, value, expected)| bad(key, value, &expected))?;
        }
        self.check_phases()
            .map_err(|(key, value, expected)| bad(key, value, &expected))?;

        let c = &self.cluster;
        if c.min_workers == 0 {
            return Err(bad("cluster.min_workers", "0".into(), "at least 1 worker"));
        }
        if c.max_workers < c.min_workers || c.max_workers > 4096 {
            return Err(bad(
                "cluster.max_workers",
                c.max_workers.to_string(),
                "at least cluster.min_workers and at most 4096",
            ));
        }
        if !(c.peer_timeout_seconds.is_finite() && (0.5..=3600.0).contains(&c.peer_timeout_seconds))
        {
            return Err(bad(
                "cluster.peer_timeout_seconds",
                c.peer_timeout_seconds.to_string(),
                "between 0.5 and 3600 seconds",
            ));
        }
        if !(c.replacement_timeout_seconds.is_finite()
            && (1.0..=604_800.0).contains(&c.replacement_timeout_seconds))
        {
            return Err(bad(
                "cluster.replacement_timeout_seconds",
                c.replacement_timeout_seconds.to_string(),
                "between 1 second and 604800 (one week)",
            ));
        }
        if !(c.progress_timeout_seconds.is_finite()
            && (1.0..=604_800.0).contains(&c.progress_timeout_seconds))
        {
            return Err(bad(
                "cluster.progress_timeout_seconds",
                c.progress_timeout_seconds.to_string(),
                "between 1 second and 604800 (one week)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
[data]
corpus = ["../corpora/en-kjv"]
vocab_size = 8000
lowercase = true
objective = "mlm"
max_seq_length = 128
masked_lm_prob = 0.15
max_predictions_per_seq = 20
heldout_fraction = 0.01
[model]
preset = "tiny"
[train]
micro_batch_size = 16
gradient_accumulation_steps = 1
max_steps = 300
optimizer = "adamw"
learning_rate = 1e-3
warmup_steps = 30
schedule = "linear"
weight_decay = 0.01
max_grad_norm = 1.0
seed = 42
checkpoint_every = 100
eval_every = 100
[cluster]
min_workers = 2
max_workers = 2
"#;

    fn err_of(text: &str) -> String {
        match JobSpec::from_toml_str(text, "job.toml") {
            Ok(spec) => panic!("expected an error, got {spec:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn the_issue_example_parses_with_its_values() {
        let spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
        assert_eq!(spec.data.vocab_size, Some(8000));
        assert_eq!(spec.data.objective, Objective::Mlm);
        assert_eq!(spec.model.preset.as_deref(), Some("tiny"));
        assert_eq!(spec.train.max_steps, 300);
        assert_eq!(spec.train.optimizer, OptimizerKind::Adamw);
        assert_eq!(spec.train.schedule, ScheduleKind::Linear);
        assert_eq!(spec.train.learning_rate, 1e-3);
        assert_eq!(spec.cluster.max_workers, 2);
        assert_eq!(spec.global_batch(2), 32);
    }

    #[test]
    fn serialised_spec_round_trips() {
        let spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
        let text = spec.to_toml_string().unwrap();
        let back = JobSpec::from_toml_str(&text, "round-trip").unwrap();
        assert_eq!(spec, back);
    }

    #[test]
    fn unknown_key_is_named() {
        let text = EXAMPLE.replace("max_steps = 300", "max_step = 300");
        let e = err_of(&text);
        assert!(e.contains("max_step"), "{e}");
        assert!(e.contains("job.toml"), "{e}");
    }

    #[test]
    fn bad_values_name_the_key_and_what_is_allowed() {
        let cases = [
            (
                "learning_rate = 1e-3",
                "learning_rate = -1.0",
                "train.learning_rate",
            ),
            ("objective = \"mlm\"", "objective = \"clm\"", "objective"),
            ("preset = \"tiny\"", "preset = \"huge\"", "model.preset"),
            (
                "masked_lm_prob = 0.15",
                "masked_lm_prob = 1.5",
                "data.masked_lm_prob",
            ),
            ("max_workers = 2", "max_workers = 1", "cluster.max_workers"),
            (
                "max_workers = 2",
                "max_workers = 2\nprogress_timeout_seconds = 0.5",
                "cluster.progress_timeout_seconds",
            ),
            (
                "max_workers = 2",
                "max_workers = 2\nprogress_timeout_seconds = inf",
                "cluster.progress_timeout_seconds",
            ),
            (
                "warmup_steps = 30",
                "warmup_steps = 3000",
                "train.warmup_steps",
            ),
            (
                "max_seq_length = 128",
                "max_seq_length = 600",
                "data.max_seq_length",
            ),
            (
                "micro_batch_size = 16",
                "micro_batch_size = 0",
                "train.micro_batch_size",
            ),
            (
                "vocab_size = 8000",
                "vocab = \"v.txt\"\nvocab_size = 8000",
                "data.vocab",
            ),
        ];
        for (from, to, key) in cases {
            let e = err_of(&EXAMPLE.replace(from, to));
            assert!(e.contains(key), "{to}: {e}");
        }
    }

    #[test]
    fn precision_defaults_to_auto_and_a_bad_one_is_named() {
        let spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
        assert_eq!(spec.train.precision, PrecisionSetting::Auto);
        let text = EXAMPLE.replace("seed = 42", "seed = 42\nprecision = \"bf16\"");
        let spec = JobSpec::from_toml_str(&text, "job.toml").unwrap();
        assert_eq!(spec.train.precision, PrecisionSetting::Bf16);
        let e = err_of(&EXAMPLE.replace("seed = 42", "seed = 42\nprecision = \"fp16\""));
        assert!(e.contains("precision") && e.contains("bf16"), "{e}");
    }

    #[test]
    fn allreduce_dtype_defaults_to_fp32_and_a_bad_one_is_named() {
        let spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
        assert_eq!(spec.train.allreduce_dtype, AllReduceDtype::Fp32);
        let text = EXAMPLE.replace("seed = 42", "seed = 42\nallreduce_dtype = \"bf16\"");
        let spec = JobSpec::from_toml_str(&text, "job.toml").unwrap();
        assert_eq!(spec.train.allreduce_dtype, AllReduceDtype::Bf16);
        let e = err_of(&EXAMPLE.replace("seed = 42", "seed = 42\nallreduce_dtype = \"fp16\""));
        assert!(e.contains("allreduce_dtype") && e.contains("bf16"), "{e}");
    }

    #[test]
    fn bucket_mib_defaults_to_4_and_must_be_1_to_1024() {
        let spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
        assert_eq!(spec.train.bucket_mib, 4);
        let text = EXAMPLE.replace("seed = 42", "seed = 42\nbucket_mib = 64");
        let spec = JobSpec::from_toml_str(&text, "job.toml").unwrap();
        assert_eq!(spec.train.bucket_mib, 64);
        for bad in ["0", "1025"] {
            let e =
                err_of(&EXAMPLE.replace("seed = 42", &format!("seed = 42\nbucket_mib = {bad}")));
            assert!(e.contains("train.bucket_mib") && e.contains("1024"), "{e}");
        }
    }

    #[test]
    fn shard_optimizer_defaults_to_false_and_is_refused_with_diloco() {
        let spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
        assert!(!spec.train.shard_optimizer);
        let text = EXAMPLE.replace("seed = 42", "seed = 42\nshard_optimizer = true");
        let spec = JobSpec::from_toml_str(&text, "job.toml").unwrap();
        assert!(spec.train.shard_optimizer);
        let e = err_of(&format!("{text}\n[diloco]\ninner_steps = 10\n"));
        assert!(
            e.contains("train.shard_optimizer") && e.contains("diloco"),
            "{e}"
        );
    }

    #[test]
    fn model_needs_exactly_one_source() {
        let e = err_of(&EXAMPLE.replace("preset = \"tiny\"", ""));
        assert!(e.contains("exactly one of model.preset"), "{e}");
    }

    #[test]
    fn relative_paths_resolve_against_the_base() {
        let mut spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
        spec.resolve_paths(Path::new("/home/u/keel"));
        assert_eq!(spec.data.corpus, vec!["/home/u/keel/../corpora/en-kjv"]);
    }
}
