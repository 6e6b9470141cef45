//! The worker's calls to the coordinator that move files: fetching its shard and the job's
//! files into the cache (verified by sha256), and uploading a checkpoint folder.

use backon::{ExponentialBuilder, Retryable};
use keel_net::auth::AuthChannel;
use keel_proto::checkpoint::{check_plain_name, sha256_file};
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{FetchFileRequest, FileChunk, JobFile, TrainingKey};
use keel_proto::transfer::Receiver;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Errors moving files between the worker and the coordinator.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The coordinator answered with an error or the connection broke.
    #[error("{what}: {status}")]
    Rpc {
        /// What was being done.
        what: String,
        /// The gRPC status.
        status: tonic::Status,
    },
    /// A local file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The bytes received do not hash to what the coordinator promised
    /// ([`keel_proto::transfer::TransferError::Checksum`]), or the stream broke the chunk
    /// protocol.
    #[error(transparent)]
    Stream(keel_proto::transfer::TransferError),
    /// The stream broke the chunk protocol (name, offset, missing last chunk).
    #[error("{0}")]
    Protocol(String),
    /// The worker's cache folder has no room for a file of the job (checked before it is
    /// fetched, or the disk filled up while it was written; nothing of it is kept).
    #[error(
        "the worker's cache folder {path} has no room for {name}: it needs {needed} bytes and \
         {free} are free (free some space or give the worker a larger --cache-dir)"
    )]
    NoRoom {
        /// The folder the file goes to.
        path: PathBuf,
        /// The file's name in the job.
        name: String,
        /// Its size, bytes.
        needed: u64,
        /// Bytes free in that folder's file system when it was found full.
        free: u64,
    },
    /// The coordinator address is malformed or unreachable.
    #[error("coordinator {addr}: {reason}")]
    Connect {
        /// The address.
        addr: String,
        /// Why.
        reason: String,
    },
}

impl From<keel_net::client::ConnectError> for TransferError {
    fn from(e: keel_net::client::ConnectError) -> Self {
        TransferError::Connect {
            addr: e.addr,
            reason: e.reason,
        }
    }
}

impl From<keel_proto::transfer::TransferError> for TransferError {
    fn from(e: keel_proto::transfer::TransferError) -> Self {
        use keel_proto::transfer::TransferError as Wire;
        match e {
            Wire::Io { path, source } => TransferError::Io { path, source },
            other => TransferError::Stream(other),
        }
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TransferError + '_ {
    move |source| TransferError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Fetches `file` into `cache_dir/files/<sha256>` unless it is already there with the right
/// checksum; returns its path. The file is written under a temporary name, verified, fsynced
/// and renamed.
///
/// Errors: [`TransferError::Rpc`], [`TransferError::Stream`] (checksum, chunk order),
/// [`TransferError::Io`], [`TransferError::Protocol`].
pub async fn fetch_cached(
    client: &mut CoordinatorClient<AuthChannel>,
    key: &TrainingKey,
    worker_id: &str,
    file: &JobFile,
    cache_dir: &Path,
) -> Result<PathBuf, TransferError> {
    check_plain_name(&file.sha256).map_err(|e| TransferError::Protocol(e.to_string()))?;
    let dir = cache_dir.join("files");
    tokio::fs::create_dir_all(&dir).await.map_err(io(&dir))?;
    let path = dir.join(&file.sha256);
    let no_room = |free: u64| TransferError::NoRoom {
        path: dir.clone(),
        name: file.name.clone(),
        needed: file.size,
        free,
    };
    if path.is_file() {
        let p = path.clone();
        let cached = tokio::task::spawn_blocking(move || sha256_file(&p).ok())
            .await
            .ok()
            .flatten();
        if cached.as_deref() == Some(file.sha256.as_str()) {
            tracing::info!(file = %file.name, "using cached copy");
            return Ok(path);
        }
    }
    // A file that cannot fit is not fetched at all (`free_bytes` failing is not a reason to
    // refuse: the write below finds out).
    if let Ok(free) = keel_proto::disk::free_bytes(&dir)
        && free < file.size
    {
        return Err(no_room(free));
    }
    let mut stream = client
        .fetch_file(FetchFileRequest {
            key: Some(key.clone()),
            worker_id: worker_id.to_string(),
            name: file.name.clone(),
        })
        .await
        .map_err(|status| TransferError::Rpc {
            what: format!("fetching {}", file.name),
            status,
        })?
        .into_inner();
    let tmp = tempfile::NamedTempFile::new_in(&dir).map_err(io(&dir))?;
    // Written through its path; removed on any error when `tmp_path` drops.
    let tmp_path = tmp.into_temp_path();
    let mut receiver = Receiver::into_file(tmp_path.to_path_buf());
    while let Some(chunk) = stream
        .message()
        .await
        .map_err(|status| TransferError::Rpc {
            what: format!("fetching {}", file.name),
            status,
        })?
    {
        receiver.accept(chunk).await.map_err(|e| match e {
            keel_proto::transfer::TransferError::Io { source, .. }
                if keel_proto::disk::is_disk_full(&source) =>
            {
                no_room(keel_proto::disk::free_bytes(&dir).unwrap_or(0))
            }
            other => TransferError::from(other),
        })?;
    }
    let ended = |detail: String| {
        TransferError::Protocol(format!(
            "{}: {detail} (the file has {} bytes)",
            file.name, file.size
        ))
    };
    let received = receiver.finish().map_err(|e| ended(e.to_string()))?;
    let Some(got) = received.into_iter().next() else {
        return Err(ended("the stream ended before its first chunk".into()));
    };
    if got.sha256 != file.sha256 {
        return Err(TransferError::Stream(
            keel_proto::transfer::TransferError::Checksum {
                name: file.name.clone(),
                path: got.path,
                expected: file.sha256.clone(),
                got: got.sha256,
            },
        ));
    }
    tmp_path.persist(&path).map_err(|e| TransferError::Io {
        path: path.clone(),
        source: e.error,
    })?;
    let written = got.size;
    tracing::info!(file = %file.name, bytes = written, "fetched and verified");
    Ok(path)
}

/// Uploads every plain file of `dir` (sorted by name) as one checkpoint stream tagged `key`.
///
/// Errors: [`TransferError::Io`] reading the files, [`TransferError::Rpc`] if the coordinator
/// refuses or the stream breaks.
pub async fn upload_dir(
    client: &mut CoordinatorClient<AuthChannel>,
    key: &TrainingKey,
    dir: &Path,
) -> Result<(), TransferError> {
    let mut names = Vec::new();
    let mut entries = tokio::fs::read_dir(dir).await.map_err(io(dir))?;
    while let Some(entry) = entries.next_entry().await.map_err(io(dir))? {
        if entry.file_type().await.map_err(io(dir))?.is_file() {
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    names.sort();
    let files: Vec<(String, PathBuf)> = names
        .into_iter()
        .map(|name| (name.clone(), dir.join(name)))
        .collect();
    let (tx, rx) = tokio::sync::mpsc::channel::<FileChunk>(4);
    let key2 = key.clone();
    let reader = tokio::spawn(async move {
        keel_proto::transfer::send_files(&files, Some(&key2), &tx, |chunk| chunk).await
    });
    let result = client
        .upload_checkpoint(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await;
    let read = reader
        .await
        .map_err(|e| TransferError::Protocol(format!("upload reader: {e}")))?;
    read?;
    result.map_err(|status| TransferError::Rpc {
        what: format!("uploading the checkpoint of step {}", key.step),
        status,
    })?;
    Ok(())
}

impl TransferError {
    /// Whether trying again later may succeed: the coordinator unreachable, restarting,
    /// overloaded or out of file descriptors (`UNAVAILABLE`, `RESOURCE_EXHAUSTED`, ...), the
    /// connection broken mid-stream, a local file briefly unreadable. A refusal of the upload
    /// itself (`INVALID_ARGUMENT`, `FAILED_PRECONDITION` for a stale key, `DATA_LOSS`, ...)
    /// would be refused again.
    pub fn is_transient(&self) -> bool {
        use tonic::Code;
        match self {
            TransferError::Rpc { status, .. } => matches!(
                status.code(),
                Code::Unavailable
                    | Code::ResourceExhausted
                    | Code::Aborted
                    | Code::DeadlineExceeded
                    // A connection that broke mid-stream (h2 or hyper errors) is `Unknown`.
                    | Code::Unknown
            ),
            TransferError::Io { .. } | TransferError::Connect { .. } => true,
            TransferError::Stream(_)
            | TransferError::Protocol(_)
            | TransferError::NoRoom { .. } => false,
        }
    }
}

impl TransferError {
    /// Whether the coordinator refused the upload because its data folder has no room for
    /// it (`RESOURCE_EXHAUSTED` with `keel_proto::transfer::DISK_FULL_METADATA`): not worth
    /// trying again at once for a periodic checkpoint; the final one waits for room.
    pub fn is_disk_full(&self) -> bool {
        matches!(self, TransferError::Rpc { status, .. }
            if status.code() == tonic::Code::ResourceExhausted
                && status.metadata().contains_key(keel_proto::transfer::DISK_FULL_METADATA))
    }
}

/// Tries of [`upload_dir_retrying`] at most (the first and the retries).
pub const UPLOAD_ATTEMPTS: u32 = 6;
/// Pause after the first failed try; doubled after each next one (0.5 s, 1, 2, 4, 8: ~15 s in
/// all, long enough for a coordinator restart or a burst of connections to pass).
pub const UPLOAD_FIRST_PAUSE: Duration = Duration::from_millis(500);

/// [`upload_dir`], tried again after transient failures ([`TransferError::is_transient`]) up
/// to [`UPLOAD_ATTEMPTS`] times with doubling pauses from `first_pause`. A refusal for a full
/// disk ([`TransferError::is_disk_full`]) is not tried again here: the coordinator has
/// recorded it, and [`upload_final`] waits for room.
///
/// Errors: the last try's, or the first that is not transient or is a full disk.
pub async fn upload_dir_retrying(
    client: &mut CoordinatorClient<AuthChannel>,
    key: &TrainingKey,
    dir: &Path,
    first_pause: Duration,
) -> Result<(), TransferError> {
    let mut attempt = 1;
    let backoff = ExponentialBuilder::new()
        .with_min_delay(first_pause)
        .with_factor(2.0)
        .without_max_delay()
        .with_max_times(UPLOAD_ATTEMPTS as usize - 1);
    let upload = || {
        let mut client = client.clone();
        async move { upload_dir(&mut client, key, dir).await }
    };
    upload
        .retry(backoff)
        .when(|e| e.is_transient() && !e.is_disk_full())
        .notify(|e, pause| {
            tracing::warn!(
                step = key.step,
                attempt,
                "checkpoint upload failed: {e}; retrying in {pause:?}"
            );
            attempt += 1;
        })
        .await
}

/// Pause between tries of the final checkpoint while the coordinator cannot store it.
pub const FINAL_UPLOAD_PAUSE: Duration = Duration::from_secs(3);

/// The final checkpoint: [`upload_dir_retrying`], and while it fails for a reason that may
/// pass (the coordinator's disk full, the coordinator away), again every
/// [`FINAL_UPLOAD_PAUSE`] until it is stored or `stop` resolves (the job cancelled, this
/// worker exiting). The trained model is never given up while it may still be stored: the
/// job waits, and says so in this log and (the coordinator records each refusal) in its
/// status.
///
/// Errors: a failure that is not transient, or the last one when `stop` resolved.
pub async fn upload_final(
    client: &mut CoordinatorClient<AuthChannel>,
    key: &TrainingKey,
    dir: &Path,
    first_pause: Duration,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), TransferError> {
    tokio::pin!(stop);
    let mut tries: u64 = 0;
    loop {
        let error = match upload_dir_retrying(client, key, dir, first_pause).await {
            Ok(()) => return Ok(()),
            Err(e) if !e.is_transient() => return Err(e),
            Err(e) => e,
        };
        tries += 1;
        tracing::warn!(
            step = key.step,
            tries,
            "the final checkpoint is not stored: {error}; holding it and trying again in \
             {FINAL_UPLOAD_PAUSE:?} (free space on the coordinator, or cancel the job)"
        );
        tokio::select! {
            () = &mut stop => return Err(error),
            () = tokio::time::sleep(FINAL_UPLOAD_PAUSE) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::TransferError;

    #[test]
    fn only_transient_upload_failures_are_retried() {
        let rpc = |code| TransferError::Rpc {
            what: "uploading".into(),
            status: tonic::Status::new(code, "x"),
        };
        for code in [
            tonic::Code::Unavailable,
            tonic::Code::ResourceExhausted,
            tonic::Code::Unknown,
        ] {
            assert!(rpc(code).is_transient(), "{code:?}");
        }
        for code in [
            tonic::Code::InvalidArgument,
            tonic::Code::FailedPrecondition,
            tonic::Code::DataLoss,
            tonic::Code::NotFound,
            tonic::Code::Unauthenticated,
            tonic::Code::Internal,
        ] {
            assert!(!rpc(code).is_transient(), "{code:?}");
        }
        // A full disk passes too, but is told apart from a passing exhaustion.
        assert!(!rpc(tonic::Code::ResourceExhausted).is_disk_full());
        let mut full = tonic::Status::resource_exhausted("no room");
        full.metadata_mut().insert(
            keel_proto::transfer::DISK_FULL_METADATA,
            tonic::metadata::MetadataValue::from_static("1"),
        );
        let full = TransferError::Rpc {
            what: "uploading".into(),
            status: full,
        };
        assert!(full.is_disk_full() && full.is_transient());
        let io = TransferError::Io {
            path: "model.safetensors".into(),
            source: std::io::Error::from_raw_os_error(24),
        };
        assert!(io.is_transient());
        assert!(!TransferError::Protocol("bad chunk".into()).is_transient());
    }
}
