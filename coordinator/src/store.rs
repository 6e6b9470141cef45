//! The checkpoint store: `JOB_DIR/checkpoints/step-N/`, one folder per stored checkpoint, in
//! the layout of `keel_proto::checkpoint`.
//!
//! Rank 0 uploads the weights, optimizer state and trainer state; the store verifies each
//! file's sha256, refuses weights or optimizer state holding NaN or Inf (the last line of
//! defence: a checkpoint never contains them, and the previous good one stays the latest),
//! adds `config.json` and the tokenizer files, writes the manifest and renames the folder
//! into place. An upload is refused when the folder has no room for it, and a failed one
//! is recorded for the job and its half-written folder removed.

use crate::CoordinatorError;
use crate::driver::Shared;
use crate::files::transfer_error;
pub use crate::layout::checkpoint_dir;
use crate::machine::{Input, Reply, UploadFailure};
use crate::prepare_job::JOB_CONFIG_FILE;
use futures::{Stream, StreamExt};
use keel_proto::checkpoint::{
    CheckpointError, MODEL_FILE, OPTIMIZER_FILE, check_plain_name, commit_dir,
};
use keel_proto::config::BertConfig;
use keel_proto::rpc::{FileChunk, TrainingKey};
use keel_proto::tokenizer::KeelTokenizer;
use keel_proto::transfer::Receiver;
use keel_proto::weights::check_finite_bytes;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An upload under way: what the error path needs to record a failure and remove the
/// half-written folder.
#[derive(Default)]
struct Upload {
    /// The key of its first chunk, once the machine accepted it.
    key: Option<TrainingKey>,
    /// The job's folder.
    job_dir: PathBuf,
    /// `JOB_DIR/checkpoints/.tmp-step-N-*`, until it is renamed into place.
    tmp: Option<tempfile::TempDir>,
    /// Bytes the whole checkpoint needs, about ([`checkpoint_bytes`]).
    needed: u64,
}

/// Receives one checkpoint upload and stores it. Returns its key.
///
/// Before it is accepted, the checkpoints folder must have room for it (about the weights and
/// the two optimizer moments, [`checkpoint_bytes`]); each file's size is checked again as it
/// begins. A failure after the key was accepted (no room, a broken stream, a bad file) is
/// recorded for the job (`Input::UploadFailed`: status, logs, `metrics.jsonl`, Prometheus),
/// and the half-written folder is removed.
///
/// Errors: `DiskFull` naming the folder, the bytes needed and free (`RESOURCE_EXHAUSTED`);
/// `BadRequest` for an empty stream, a bad file name or a chunk out of order;
/// `Checkpoint(ChecksumMismatch)` when a file's bytes do not match its sha256;
/// `Weights(NonFinite)` naming the tensor when `model.safetensors` or
/// `optimizer.safetensors` holds NaN or Inf (`Weights(Format)` when it is not safetensors);
/// `Stale` / `UnknownJob` for a key that is not current; `Io`.
pub async fn receive_upload<S>(
    shared: Arc<Shared>,
    mut stream: S,
) -> Result<TrainingKey, CoordinatorError>
where
    S: Stream<Item = Result<FileChunk, tonic::Status>> + Unpin,
{
    let mut upload = Upload::default();
    let result = receive(&shared, &mut stream, &mut upload).await;
    let Err(error) = result else {
        return result;
    };
    if let Some(tmp) = upload.tmp.take() {
        let path = tmp.path().to_path_buf();
        if let Err(e) = tmp.close() {
            tracing::warn!(path = %path.display(), "cannot remove a failed checkpoint upload: {e}");
        }
    }
    let Some(key) = upload.key else {
        return Err(error);
    };
    let folder = upload.job_dir.join("checkpoints");
    // A file system that filled up during the upload says so as an I/O error.
    let disk_full = match &error {
        CoordinatorError::Io { source, .. }
        | CoordinatorError::Checkpoint(CheckpointError::Io { source, .. }) => {
            crate::disk::is_disk_full(source)
        }
        _ => false,
    };
    let error = if disk_full {
        CoordinatorError::DiskFull {
            free: crate::disk::free_bytes(&folder).unwrap_or(0),
            path: folder.clone(),
            step: key.step,
            needed: upload.needed,
        }
    } else {
        error
    };
    let (needed_bytes, free_bytes) = match &error {
        CoordinatorError::DiskFull { needed, free, .. } => (Some(*needed), Some(*free)),
        _ => (None, None),
    };
    tracing::warn!(job = %key.job_id, step = key.step, "checkpoint upload failed: {error}");
    let _ = shared.apply(Input::UploadFailed(UploadFailure {
        key,
        path: folder,
        needed_bytes,
        free_bytes,
        error: error.to_string(),
    }));
    Err(error)
}

/// Bytes a checkpoint of the job in `job_dir` takes, about: the weights and the optimizer's
/// two moments in f32 (12 bytes a parameter of its `config.json`), the tokenizer files and a
/// margin of 1 MiB.
pub fn checkpoint_bytes(job_dir: &Path) -> u64 {
    let params = BertConfig::from_json_file(job_dir.join(JOB_CONFIG_FILE))
        .ok()
        .and_then(|c| keel_proto::memory::estimate(&c, 1, 1).ok())
        .map_or(0, |e| e.params);
    let tokenizer =
        std::fs::metadata(job_dir.join("data").join("tokenizer.json")).map_or(0, |m| m.len());
    params
        .saturating_mul(12)
        .saturating_add(tokenizer.saturating_mul(2))
        .saturating_add(1 << 20)
}

/// Refuses with `DiskFull` when `folder` has less than `needed` bytes free.
fn check_room(folder: &Path, step: u64, needed: u64) -> Result<(), CoordinatorError> {
    let free = crate::disk::free_bytes(folder).map_err(CoordinatorError::io(folder))?;
    if free < needed {
        return Err(CoordinatorError::DiskFull {
            path: folder.to_path_buf(),
            step,
            needed,
            free,
        });
    }
    Ok(())
}

/// The body of [`receive_upload`]; `upload` keeps what its error path needs.
async fn receive<S>(
    shared: &Arc<Shared>,
    stream: &mut S,
    upload: &mut Upload,
) -> Result<TrainingKey, CoordinatorError>
where
    S: Stream<Item = Result<FileChunk, tonic::Status>> + Unpin,
{
    let mut receiver: Option<Receiver> = None;
    while let Some(chunk) = stream.next().await {
        let chunk =
            chunk.map_err(|s| CoordinatorError::BadRequest(format!("upload stream: {s}")))?;
        if upload.key.is_none() {
            let k = chunk.key.clone().ok_or_else(|| {
                CoordinatorError::BadRequest("first upload chunk has no key".into())
            })?;
            // Refused for a key that is not current, or a job that has ended.
            match shared.apply(Input::UploadBegins(k.clone()))? {
                Reply::JobDir(dir) => upload.job_dir = dir,
                other => {
                    return Err(CoordinatorError::BadRequest(format!(
                        "unexpected reply to an upload: {other:?}"
                    )));
                }
            }
            upload.key = Some(k.clone());
            let parent = upload.job_dir.join("checkpoints");
            std::fs::create_dir_all(&parent).map_err(CoordinatorError::io(&parent))?;
            upload.needed = checkpoint_bytes(&upload.job_dir);
            check_room(&parent, k.step, upload.needed)?;
            upload.tmp = Some(
                tempfile::Builder::new()
                    .prefix(&format!(
                        "{}{}-",
                        crate::disk::PARTIAL_UPLOAD_PREFIX,
                        k.step
                    ))
                    .tempdir_in(&parent)
                    .map_err(CoordinatorError::io(&parent))?,
            );
        }
        let Some(dir) = upload.tmp.as_ref().map(|t| t.path().to_path_buf()) else {
            continue;
        };
        check_plain_name(&chunk.name)?;
        if chunk.offset == 0
            && let Some(k) = &upload.key
        {
            // Each file, as it begins: the estimate may be short of what arrives.
            check_room(&dir, k.step, chunk.size)?;
        }
        receiver
            .get_or_insert_with(|| Receiver::into_dir(dir))
            .accept(chunk)
            .await
            .map_err(transfer_error)?;
        if let Some(k) = &upload.key {
            // A long upload (the final checkpoint of a big model) is progress: no step
            // follows it, and the watchdog must not take it for a stall.
            let _ = shared.apply(Input::UploadProgress(k.clone()));
        }
    }
    if let Some(receiver) = receiver {
        receiver.finish().map_err(transfer_error)?;
    }
    let (Some(key), Some(tmp)) = (upload.key.clone(), upload.tmp.take()) else {
        return Err(CoordinatorError::BadRequest(
            "empty checkpoint upload".into(),
        ));
    };
    let step = key.step;
    let job_dir = upload.job_dir.clone();
    let final_dir = checkpoint_dir(&job_dir, step);
    let job_id = key.job_id.clone();
    let stored = tokio::task::spawn_blocking(
        move || -> Result<(), (CoordinatorError, tempfile::TempDir)> {
            let dir = tmp.path().to_path_buf();
            match finish_dir(&dir, &job_dir, &final_dir, step, &job_id) {
                // Renamed into place: nothing left for `tmp` to remove.
                Ok(()) => {
                    let _ = tmp.keep();
                    Ok(())
                }
                Err(e) => Err((e, tmp)),
            }
        },
    )
    .await
    .map_err(|e| CoordinatorError::BadRequest(format!("checkpoint task: {e}")))?;
    if let Err((e, tmp)) = stored {
        // Back to the error path, which removes it.
        upload.tmp = Some(tmp);
        return Err(e);
    }
    shared.apply(Input::CheckpointStored(key.clone()))?;
    Ok(key)
}

/// Checks an uploaded folder's weights and optimizer state for NaN and Inf, adds the job's
/// `config.json` and tokenizer files, and renames it to `final_dir` with its manifest.
fn finish_dir(
    dir: &Path,
    job_dir: &Path,
    final_dir: &Path,
    step: u64,
    job_id: &str,
) -> Result<(), CoordinatorError> {
    for name in [MODEL_FILE, OPTIMIZER_FILE] {
        let path = dir.join(name);
        if path.is_file() {
            let bytes = std::fs::read(&path).map_err(CoordinatorError::io(&path))?;
            let origin = format!("checkpoint upload of step {step}: {name}");
            check_finite_bytes(&bytes, &origin).map_err(|e| {
                tracing::warn!(job = %job_id, step, "checkpoint refused: {e}");
                e
            })?;
        }
    }
    let config_src = job_dir.join(JOB_CONFIG_FILE);
    let config_dst = dir.join(JOB_CONFIG_FILE);
    std::fs::copy(&config_src, &config_dst).map_err(CoordinatorError::io(&config_dst))?;
    let vocab = job_dir.join("data").join("tokenizer.json");
    let tokenizer = KeelTokenizer::from_tokenizer_json(&vocab)
        .map_err(|e| CoordinatorError::BadRequest(format!("{}: {e}", vocab.display())))?;
    tokenizer
        .save(dir)
        .map_err(|e| CoordinatorError::BadRequest(format!("saving tokenizer: {e}")))?;
    commit_dir(dir, final_dir)?;
    Ok(())
}

/// The files of a stored checkpoint, manifest first, then the others by name.
///
/// Errors: `NotFound` if the folder does not exist; `Io`.
pub fn checkpoint_files(
    job_dir: &Path,
    step: u64,
) -> Result<Vec<(String, PathBuf)>, CoordinatorError> {
    let dir = checkpoint_dir(job_dir, step);
    if !dir.is_dir() {
        return Err(CoordinatorError::NotFound(format!(
            "no checkpoint at step {step}"
        )));
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(CoordinatorError::io(&dir))? {
        let entry = entry.map_err(CoordinatorError::io(&dir))?;
        // Regular files only, never followed links: nothing outside the folder is served.
        let regular = entry.file_type().is_ok_and(|t| t.is_file());
        let name = entry.file_name().to_string_lossy().into_owned();
        if regular && check_plain_name(&name).is_ok() {
            files.push((name, entry.path()));
        }
    }
    // The manifest first: the client then knows every file's size before its first byte and
    // stops a file at the first byte past it (clients that read it last still find it).
    files.sort_by_key(|(name, _)| (name != keel_proto::checkpoint::MANIFEST_FILE, name.clone()));
    Ok(files)
}
