//! The checkpoint store: `JOB_DIR/checkpoints/step-N/`, one folder per stored checkpoint, in
//! the layout of `keel_proto::checkpoint`.
//!
//! Rank 0 uploads the weights, optimizer state and trainer state; the store verifies each
//! file's sha256, refuses weights or optimizer state holding NaN or Inf (the last line of
//! defence: a checkpoint never contains them, and the previous good one stays the latest),
//! adds `config.json` and the tokenizer files, writes the manifest and renames the folder
//! into place.

use crate::CoordinatorError;
use crate::driver::Shared;
use crate::files::transfer_error;
pub use crate::layout::checkpoint_dir;
use crate::machine::{Input, Reply};
use crate::prepare_job::JOB_CONFIG_FILE;
use futures::{Stream, StreamExt};
use keel_proto::checkpoint::{MODEL_FILE, OPTIMIZER_FILE, check_plain_name, commit_dir};
use keel_proto::rpc::{FileChunk, TrainingKey};
use keel_proto::tokenizer::KeelTokenizer;
use keel_proto::transfer::Receiver;
use keel_proto::weights::check_finite_bytes;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Receives one checkpoint upload and stores it. Returns its key.
///
/// Errors: `BadRequest` for an empty stream, a bad file name or a chunk out of order;
/// `Checkpoint(ChecksumMismatch)` when a file's bytes do not match its sha256;
/// `Weights(NonFinite)` naming the tensor when `model.safetensors` or
/// `optimizer.safetensors` holds NaN or Inf (`Weights(Format)` when it is not safetensors);
/// `Stale` /
/// `UnknownJob` for a key that is not current; `Io`.
pub async fn receive_upload<S>(
    shared: Arc<Shared>,
    mut stream: S,
) -> Result<TrainingKey, CoordinatorError>
where
    S: Stream<Item = Result<FileChunk, tonic::Status>> + Unpin,
{
    let mut key: Option<TrainingKey> = None;
    let mut tmp: Option<tempfile::TempDir> = None;
    let mut job_dir = PathBuf::new();
    let mut receiver: Option<Receiver> = None;
    while let Some(chunk) = stream.next().await {
        let chunk =
            chunk.map_err(|s| CoordinatorError::BadRequest(format!("upload stream: {s}")))?;
        if key.is_none() {
            let k = chunk.key.clone().ok_or_else(|| {
                CoordinatorError::BadRequest("first upload chunk has no key".into())
            })?;
            // Refused for a key that is not current, or a job that has ended.
            match shared.apply(Input::UploadBegins(k.clone()))? {
                Reply::JobDir(dir) => job_dir = dir,
                other => {
                    return Err(CoordinatorError::BadRequest(format!(
                        "unexpected reply to an upload: {other:?}"
                    )));
                }
            }
            let parent = job_dir.join("checkpoints");
            std::fs::create_dir_all(&parent).map_err(CoordinatorError::io(&parent))?;
            tmp = Some(
                tempfile::Builder::new()
                    .prefix(&format!(".tmp-step-{}-", k.step))
                    .tempdir_in(&parent)
                    .map_err(CoordinatorError::io(&parent))?,
            );
            key = Some(k);
        }
        let Some(dir) = tmp.as_ref().map(|t| t.path().to_path_buf()) else {
            continue;
        };
        check_plain_name(&chunk.name)?;
        receiver
            .get_or_insert_with(|| Receiver::into_dir(dir))
            .accept(chunk)
            .await
            .map_err(transfer_error)?;
        if let Some(k) = &key {
            // A long upload (the final checkpoint of a big model) is progress: no step
            // follows it, and the watchdog must not take it for a stall.
            let _ = shared.apply(Input::UploadProgress(k.clone()));
        }
    }
    if let Some(receiver) = receiver {
        receiver.finish().map_err(transfer_error)?;
    }
    let (Some(key), Some(tmp)) = (key, tmp) else {
        return Err(CoordinatorError::BadRequest(
            "empty checkpoint upload".into(),
        ));
    };
    let step = key.step;
    let final_dir = checkpoint_dir(&job_dir, step);
    let job_dir2 = job_dir.clone();
    let job_id = key.job_id.clone();
    tokio::task::spawn_blocking(move || -> Result<(), CoordinatorError> {
        // Until the rename, dropping `tmp` (on any error) removes the half-made folder.
        let dir = tmp.path().to_path_buf();
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
        let config_src = job_dir2.join(JOB_CONFIG_FILE);
        let config_dst = dir.join(JOB_CONFIG_FILE);
        std::fs::copy(&config_src, &config_dst).map_err(CoordinatorError::io(&config_src))?;
        let vocab = job_dir2.join("data").join("tokenizer.json");
        let tokenizer = KeelTokenizer::from_tokenizer_json(&vocab)
            .map_err(|e| CoordinatorError::BadRequest(format!("{}: {e}", vocab.display())))?;
        tokenizer
            .save(&dir)
            .map_err(|e| CoordinatorError::BadRequest(format!("saving tokenizer: {e}")))?;
        commit_dir(&dir, &final_dir)?;
        // Renamed into place: nothing left for `tmp` to remove.
        let _ = tmp.keep();
        Ok(())
    })
    .await
    .map_err(|e| CoordinatorError::BadRequest(format!("checkpoint task: {e}")))??;

    shared.apply(Input::CheckpointStored(key.clone()))?;
    Ok(key)
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
