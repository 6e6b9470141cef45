//! A job's inputs: its prepared data (through `crate::data`), its model config, and the files
//! each rank fetches.
//!
//! Everything here is blocking (tokenizing, sharding, hashing): the driver (`crate::driver`)
//! runs it on threads of its own, never under the machine's lock.

use crate::CoordinatorError;
use crate::data::{PrepareOptions, VocabSource};
use crate::input_roots::InputRoots;
use keel_proto::checkpoint::{sha256_file, write_file_atomic};
use keel_proto::config::BertConfig;
use keel_proto::jobspec::{JobSpec, ModelSource, Objective, Vocabulary};
use keel_proto::params::Heads;
use keel_proto::rpc::JobFile;
use keel_proto::split::WorkerPlan;
use keel_proto::tokenizer::KeelTokenizer;
use std::path::{Path, PathBuf};

/// What preparation produced: everything needed to assign the job to workers.
#[derive(Debug, Clone)]
pub struct PreparedJob {
    /// The prepared data folder (vocab.txt, tokenizer.json, shard-*.keel, heldout.keel).
    pub data_dir: PathBuf,
    /// Training sequences in the whole set.
    pub total_sequences: u64,
    /// The model's HF `config.json` text.
    pub model_config_json: String,
    /// `(role, path)` of files every rank fetches (heldout, vocab, tokenizer, init weights).
    pub shared_files: Vec<(String, PathBuf)>,
    /// Estimated bytes to train the model on one rank (`keel_proto::memory::estimate`, the
    /// largest over the job's phases): only workers whose memory limit holds it are given
    /// the job.
    pub memory_bytes: u64,
    /// The data of each phase after the first (`[[phase]]`, `keel_proto::phases`), in order:
    /// `data` again where the phase keeps phase 1's `max_seq_length`, else `data-seq-L`.
    pub later_phases: Vec<PhaseData>,
}

/// One later phase's prepared data.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseData {
    /// Its prepared data folder (shards and `heldout.keel`, tokenised with phase 1's
    /// vocabulary).
    pub data_dir: PathBuf,
    /// Training sequences in its whole set.
    pub total_sequences: u64,
}

impl PreparedJob {
    /// The data folder and training sequences of phase `p` (0-based; phase 1's for a phase
    /// the job does not have).
    pub fn phase_data(&self, p: usize) -> (&Path, u64) {
        match p.checked_sub(1).and_then(|i| self.later_phases.get(i)) {
            Some(d) => (&d.data_dir, d.total_sequences),
            None => (&self.data_dir, self.total_sequences),
        }
    }
}

/// The data folder of a later phase with `max_seq_length` tokens per sequence: phase 1's
/// `data` when the length is phase 1's (the data do not depend on the batch), else
/// `data-seq-L`.
pub fn phase_data_dir(job_dir: &Path, spec: &JobSpec, max_seq_length: usize) -> PathBuf {
    if max_seq_length == spec.data.max_seq_length {
        job_dir.join("data")
    } else {
        job_dir.join(format!("data-seq-{max_seq_length}"))
    }
}

/// Role of phase `n`'s shard (`n` >= 2, 1-based), followed by `n`: `shard_phase2`.
pub const SHARD_PHASE_ROLE: &str = keel_proto::phases::SHARD_PHASE_ROLE;

/// Role of phase `n`'s held-out set when it has data of its own: `heldout_phase2`.
pub const HELDOUT_PHASE_ROLE: &str = keel_proto::phases::HELDOUT_PHASE_ROLE;

/// File name of the model config kept in the job folder (copied into every checkpoint).
pub const JOB_CONFIG_FILE: &str = "config.json";

/// File in the job folder counting preparations that started and never ended (the
/// coordinator stopped, or was killed, while preparing): written before each attempt, removed
/// when it ends either way.
pub const ATTEMPTS_FILE: &str = "preparation-attempts";

/// Preparations that may be interrupted before a restart stops retrying the job (it then
/// fails, saying so): a job that kills the coordinator each time it is prepared (memory)
/// would otherwise do so at every restart.
pub const MAX_INTERRUPTED_PREPARATIONS: u32 = 2;

/// Preparations of the job in `job_dir` that started and did not end (0 if none).
pub fn interrupted_preparations(job_dir: &Path) -> u32 {
    std::fs::read_to_string(job_dir.join(ATTEMPTS_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Records that a preparation of the job in `job_dir` starts (one more attempt).
///
/// Errors: `Io` if the file cannot be written.
pub fn begin_attempt(job_dir: &Path) -> Result<(), CoordinatorError> {
    let n = interrupted_preparations(job_dir) + 1;
    write_file_atomic(&job_dir.join(ATTEMPTS_FILE), n.to_string().as_bytes())?;
    Ok(())
}

/// Records that the preparation ended (succeeded or failed with a reason).
pub fn end_attempt(job_dir: &Path) {
    let _ = std::fs::remove_file(job_dir.join(ATTEMPTS_FILE));
}

/// [`prepare`] after checking the job's paths against `roots` again
/// ([`InputRoots::check_spec`]): what a corpus folder or glob expands to now, symlinks
/// resolved, may differ from what it expanded to at submit.
///
/// Errors: [`CoordinatorError::Prepare`] naming the key, the path and the roots, or as
/// [`prepare`].
pub fn prepare_within(
    job_id: &str,
    spec: &JobSpec,
    job_dir: &Path,
    roots: &InputRoots,
) -> Result<PreparedJob, CoordinatorError> {
    roots
        .check_spec(spec, job_id)
        .map_err(|e| CoordinatorError::Prepare {
            job_id: job_id.to_string(),
            message: e.to_string(),
        })?;
    prepare(job_id, spec, job_dir)
}

/// Prepares a job: tokenizes and shards the corpus into `job_dir/data`, builds the model
/// config (`job_dir/config.json`) and lists the files every rank fetches. A data folder that
/// an earlier run of the same job completed (its manifest is written last) is reused as it
/// is: after a coordinator restart the job keeps the very data (and vocabulary) it had.
///
/// Errors: [`CoordinatorError::Prepare`] naming what failed (corpus, vocabulary, config).
pub fn prepare(
    job_id: &str,
    spec: &JobSpec,
    job_dir: &Path,
) -> Result<PreparedJob, CoordinatorError> {
    match reuse(job_id, spec, job_dir) {
        Ok(Some(prepared)) => {
            tracing::info!(job = job_id, data = %prepared.data_dir.display(), "reusing the prepared data");
            return Ok(prepared);
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(job = job_id, "preparing again: {e}"),
    }
    let fail = |message: String| CoordinatorError::Prepare {
        job_id: job_id.to_string(),
        message,
    };
    let data_dir = job_dir.join("data");
    let lowercase = spec.data.lowercase;
    let vocab = match &spec.data.vocabulary {
        Vocabulary::File(path) => VocabSource::File {
            path: path.clone(),
            lowercase,
        },
        Vocabulary::Train { vocab_size } => VocabSource::Train {
            vocab_size: *vocab_size,
            lowercase,
        },
    };
    let objective = match spec.data.objective {
        Objective::Mlm => crate::data::Objective::Mlm,
        Objective::MlmNsp => crate::data::Objective::MlmNsp,
    };
    let corpus = spec.data.corpus.iter().map(PathBuf::from).collect();
    let mut options = PrepareOptions::new(corpus, vocab, objective, data_dir.clone());
    options.max_seq_length = spec.data.max_seq_length;
    options.shards = spec.data.shards.max(1);
    options.seed = spec.train.seed;
    options.heldout_fraction = spec.data.heldout_fraction;
    // With phases the corpus is cut at several lengths: hold out the same documents in each.
    options.heldout_by_document = !spec.phases.is_empty();
    options.threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let total_sequences = match open_complete(&data_dir) {
        Some(Ok(total)) => total,
        _ => {
            crate::data::prepare(&options)
                .map_err(|e| fail(format!("data: {e}")))?
                .total_sequences
        }
    };
    let later_phases = prepare_later_phases(job_id, spec, job_dir, &options)?;
    finish(job_id, spec, job_dir, total_sequences, later_phases)
}

/// Training sequences of the prepared data in `dir` when it is complete (has its manifest);
/// `None` when it has none.
fn open_complete(dir: &Path) -> Option<Result<u64, String>> {
    if !dir.join(crate::data::prepare::MANIFEST_FILE).is_file() {
        return None;
    }
    Some(
        crate::data::PreparedData::open(dir)
            .map(|d| d.total_sequences())
            .map_err(|e| format!("{}: {e}", dir.display())),
    )
}

/// Prepares the data of every later phase whose `max_seq_length` differs from phase 1's, each
/// length once, with phase 1's tokenizer (`data/tokenizer.json`: the same vocabulary and
/// normaliser) and phase 1's other settings (`options`); a folder an earlier run completed is
/// reused.
///
/// Errors: [`CoordinatorError::Prepare`] naming the phase and what failed.
fn prepare_later_phases(
    job_id: &str,
    spec: &JobSpec,
    job_dir: &Path,
    options: &PrepareOptions,
) -> Result<Vec<PhaseData>, CoordinatorError> {
    let mut out = Vec::with_capacity(spec.phases.len());
    for p in 1..spec.phase_count() {
        let length = spec.phase_view(p).data.max_seq_length;
        let dir = phase_data_dir(job_dir, spec, length);
        let fail = |message: String| CoordinatorError::Prepare {
            job_id: job_id.to_string(),
            message: format!("phase {} (max_seq_length {length}): {message}", p + 1),
        };
        let total_sequences = match open_complete(&dir) {
            Some(Ok(total)) => total,
            _ => {
                let mut phase = options.clone();
                phase.vocab = VocabSource::File {
                    path: job_dir.join("data").join("tokenizer.json"),
                    lowercase: spec.data.lowercase,
                };
                phase.max_seq_length = length;
                phase.out_dir = dir.clone();
                crate::data::prepare(&phase)
                    .map_err(|e| fail(format!("data: {e}")))?
                    .total_sequences
            }
        };
        out.push(PhaseData {
            data_dir: dir,
            total_sequences,
        });
    }
    Ok(out)
}

/// The job's preparation from its existing `job_dir/data` when that folder is complete (its
/// manifest, tokenizer and shards check out), with the model config rebuilt; `None` when
/// there is no manifest (never prepared, or interrupted).
///
/// Errors: [`CoordinatorError::Prepare`] if the folder has a manifest but does not open, or
/// the model config cannot be built.
pub fn reuse(
    job_id: &str,
    spec: &JobSpec,
    job_dir: &Path,
) -> Result<Option<PreparedJob>, CoordinatorError> {
    let fail = |message: String| CoordinatorError::Prepare {
        job_id: job_id.to_string(),
        message,
    };
    let Some(total_sequences) = open_complete(&job_dir.join("data")) else {
        return Ok(None);
    };
    let total_sequences = total_sequences.map_err(fail)?;
    let mut later_phases = Vec::with_capacity(spec.phases.len());
    for p in 1..spec.phase_count() {
        let dir = phase_data_dir(job_dir, spec, spec.phase_view(p).data.max_seq_length);
        let Some(total) = open_complete(&dir) else {
            return Ok(None);
        };
        later_phases.push(PhaseData {
            data_dir: dir,
            total_sequences: total.map_err(fail)?,
        });
    }
    finish(job_id, spec, job_dir, total_sequences, later_phases).map(Some)
}

/// What follows the data: the model config (written to `job_dir/config.json`) and the files
/// every rank fetches.
fn finish(
    job_id: &str,
    spec: &JobSpec,
    job_dir: &Path,
    total_sequences: u64,
    later_phases: Vec<PhaseData>,
) -> Result<PreparedJob, CoordinatorError> {
    let fail = |message: String| CoordinatorError::Prepare {
        job_id: job_id.to_string(),
        message,
    };
    let data_dir = job_dir.join("data");
    let vocab_path = data_dir.join("vocab.txt");
    let tokenizer_path = data_dir.join("tokenizer.json");
    let tokenizer = KeelTokenizer::from_tokenizer_json(&tokenizer_path)
        .map_err(|e| fail(format!("{}: {e}", tokenizer_path.display())))?;
    let vocab_size = tokenizer.vocab_size();

    let heads = match spec.data.objective {
        Objective::Mlm => Heads::MaskedLm,
        Objective::MlmNsp => Heads::PreTraining,
    };
    let mut shared_files = vec![
        ("heldout".to_string(), data_dir.join("heldout.keel")),
        ("vocab".to_string(), vocab_path.clone()),
        ("tokenizer".to_string(), tokenizer_path),
    ];
    // A later phase with data of its own evaluates on its own held-out set.
    for (i, phase) in later_phases.iter().enumerate() {
        if phase.data_dir != data_dir {
            let role = format!("{}{}", HELDOUT_PHASE_ROLE, i + 2);
            shared_files.push((role, phase.data_dir.join("heldout.keel")));
        }
    }
    let mut config = match &spec.model.source {
        ModelSource::Preset(preset) => BertConfig::preset(preset, vocab_size)
            .map_err(|e| fail(format!("model.preset: {e}")))?,
        ModelSource::Config(path) => BertConfig::from_json_file(path)
            .map_err(|e| fail(format!("{}: {e}", path.display())))?,
        ModelSource::InitCheckpoint(dir) => {
            let path = dir.join("config.json");
            let weights = dir.join("model.safetensors");
            if !weights.is_file() {
                return Err(fail(format!("{}: no such file", weights.display())));
            }
            shared_files.push(("init_weights".to_string(), weights));
            BertConfig::from_json_file(&path)
                .map_err(|e| fail(format!("{}: {e}", path.display())))?
        }
    };
    if config.vocab_size != vocab_size {
        if spec.model.preset().is_some() {
            config.vocab_size = vocab_size;
        } else {
            return Err(fail(format!(
                "the model config has vocab_size {} but the vocabulary {} has {vocab_size} entries",
                config.vocab_size,
                vocab_path.display()
            )));
        }
    }
    for (p, view) in spec.phase_views().iter().enumerate() {
        if config.max_position_embeddings < view.data.max_seq_length {
            let key = if p == 0 { "data" } else { "phase" };
            return Err(fail(format!(
                "{key}.max_seq_length {} (phase {}) exceeds the model's max_position_embeddings {}",
                view.data.max_seq_length,
                p + 1,
                config.max_position_embeddings
            )));
        }
    }
    if let Some(p) = spec.model.dropout {
        config.hidden_dropout_prob = p;
        config.attention_probs_dropout_prob = p;
    }
    let config = config.with_heads(heads);
    config
        .validate()
        .map_err(|e| fail(format!("model config: {e}")))?;
    if let ModelSource::InitCheckpoint(dir) = &spec.model.source {
        check_init_checkpoint(dir, &config, heads).map_err(fail)?;
    }
    let memory_bytes = crate::admission::estimate_for(&config, spec, "model config")
        .map_err(|e| fail(e.to_string()))?
        .total_bytes;
    let model_config_json = config.to_json_pretty();
    write_file_atomic(&job_dir.join(JOB_CONFIG_FILE), model_config_json.as_bytes())?;
    Ok(PreparedJob {
        data_dir,
        total_sequences,
        model_config_json,
        shared_files,
        memory_bytes,
        later_phases,
    })
}

/// Checks `init_checkpoint` before any worker fetches it: the folder's manifest when it has
/// one (a folder from `save_pretrained` has none and is taken as it is), then every tensor of
/// the model's layout present with its shape, and no NaN or Inf.
///
/// Errors: a message naming the file and what differs (size, sha256, a missing file), or the
/// tensor (missing, misshaped, non-finite).
fn check_init_checkpoint(dir: &Path, config: &BertConfig, heads: Heads) -> Result<(), String> {
    keel_proto::checkpoint::verify_dir(dir).map_err(|e| format!("model.init_checkpoint: {e}"))?;
    let weights = dir.join(keel_proto::checkpoint::MODEL_FILE);
    let layout = keel_proto::params::ParamLayout::bert(config, heads);
    keel_proto::weights::load_safetensors(&weights, &layout)
        .map_err(|e| format!("model.init_checkpoint: {e}"))?;
    keel_proto::weights::check_finite(&weights)
        .map_err(|e| format!("model.init_checkpoint: {e}"))?;
    Ok(())
}

/// Builds rank `rank`'s shard (the sequences its plan names) and lists the files it fetches,
/// with their sha256. Returns `(name, path, JobFile)` per file.
///
/// Errors: [`CoordinatorError::Prepare`] if the shard cannot be built, `Io` if unreadable.
pub fn rank_files(
    job_id: &str,
    spec: &JobSpec,
    prepared: &PreparedJob,
    job_dir: &Path,
    world_size: usize,
    rank: usize,
    global_batch: u64,
) -> Result<Vec<(String, PathBuf, JobFile)>, CoordinatorError> {
    let fail = |message: String| CoordinatorError::Prepare {
        job_id: job_id.to_string(),
        message,
    };
    let ranks_dir = job_dir.join("ranks");
    std::fs::create_dir_all(&ranks_dir).map_err(CoordinatorError::io(&ranks_dir))?;
    let mut files = Vec::with_capacity(spec.phase_count() + prepared.shared_files.len());
    // One shard per phase: each phase has its own data and global batch, so its own plan.
    for p in 0..spec.phase_count() {
        let (data_dir, total_sequences) = prepared.phase_data(p);
        let data = crate::data::PreparedData::open(data_dir)
            .map_err(|e| fail(format!("{}: {e}", data_dir.display())))?;
        let view = spec.phase_view(p);
        let plan = WorkerPlan::with_global_batch(
            total_sequences,
            spec.phase_global_batch(p, global_batch),
            world_size as u32,
            rank as u32,
            view.train.micro_batch_size as u32,
        )
        .map_err(|e| {
            fail(format!(
                "data plan of phase {} for rank {rank} of {world_size}: {e}",
                p + 1
            ))
        })?;
        let (name, role) = match p {
            0 => (
                format!("rank-{rank}-of-{world_size}.keel"),
                "shard".to_string(),
            ),
            _ => (
                format!("rank-{rank}-of-{world_size}-phase-{}.keel", p + 1),
                format!("{SHARD_PHASE_ROLE}{}", p + 1),
            ),
        };
        let shard_path = ranks_dir.join(name);
        crate::data::build_worker_shard(&data, &plan, &shard_path)
            .map_err(|e| fail(format!("shard of phase {} for rank {rank}: {e}", p + 1)))?;
        files.push((role, shard_path));
    }
    files.extend(prepared.shared_files.iter().cloned());
    files
        .into_iter()
        .map(|(role, path)| job_file(role, path))
        .collect()
}

/// A file a worker fetches, as `(name, path, JobFile)`: its name is the role and the first
/// 16 hex digits of its sha256 (unique per content: workers cache by it).
///
/// Errors: `Io` if unreadable.
pub fn job_file(
    role: String,
    path: PathBuf,
) -> Result<(String, PathBuf, JobFile), CoordinatorError> {
    let sha256 = sha256_file(&path)?;
    let size = std::fs::metadata(&path)
        .map_err(CoordinatorError::io(&path))?
        .len();
    let name = format!("{role}-{}", &sha256[..16]);
    let file = JobFile {
        name: name.clone(),
        role,
        sha256,
        size,
    };
    Ok((name, path, file))
}
