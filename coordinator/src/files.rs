//! Streams files as [`FileChunk`]s with the one sender of [`keel_proto::transfer`] (chunks of
//! `FILE_CHUNK_BYTES`, the last one carrying the file's sha256 so the receiver can verify
//! what it wrote).

use crate::CoordinatorError;
use keel_proto::rpc::FileChunk;
use keel_proto::transfer::TransferError;
use std::path::PathBuf;
use tokio::sync::mpsc;
use tonic::Status;

/// Sends the files `(name, path)` one after another on `tx` as chunks. Stops early (without
/// error) when the receiver hangs up.
///
/// Errors: sends a `Status` (not found / internal) on `tx` when a file cannot be read.
pub async fn send_files(
    files: Vec<(String, PathBuf)>,
    tx: mpsc::Sender<Result<FileChunk, Status>>,
) {
    if let Err(e) = keel_proto::transfer::send_files(&files, None, &tx, Ok).await {
        let _ = tx.send(Err(transfer_error(e).into())).await;
    }
}

/// A transfer's error as the coordinator reports it: `Io` naming the file, a checksum
/// mismatch as `Checkpoint(ChecksumMismatch)`, a broken chunk protocol as `BadRequest`.
pub(crate) fn transfer_error(e: TransferError) -> CoordinatorError {
    match e {
        TransferError::Io { path, source } => CoordinatorError::Io { path, source },
        TransferError::Checksum {
            path,
            expected,
            got,
            ..
        } => keel_proto::checkpoint::CheckpointError::ChecksumMismatch {
            path,
            expected,
            got,
        }
        .into(),
        TransferError::Protocol(message) => CoordinatorError::BadRequest(message),
    }
}
