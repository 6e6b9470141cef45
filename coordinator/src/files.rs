//! Streams a file as [`FileChunk`]s of [`FILE_CHUNK_BYTES`], the last one carrying the file's
//! sha256 so the receiver can verify what it wrote.

use crate::CoordinatorError;
use keel_proto::protocol::FILE_CHUNK_BYTES;
use keel_proto::rpc::FileChunk;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use tokio::io::AsyncReadExt;
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
    for (name, path) in files {
        if let Err(e) = send_file(&name, &path, &tx).await {
            let _ = tx.send(Err(e.into())).await;
            return;
        }
    }
}

async fn send_file(
    name: &str,
    path: &Path,
    tx: &mpsc::Sender<Result<FileChunk, Status>>,
) -> Result<(), CoordinatorError> {
    let mut file = tokio::fs::File::open(path)
        .await
        .map_err(CoordinatorError::io(path))?;
    let size = file
        .metadata()
        .await
        .map_err(CoordinatorError::io(path))?
        .len();
    let mut hasher = Sha256::new();
    let mut offset = 0u64;
    loop {
        let mut buf = vec![0u8; FILE_CHUNK_BYTES];
        let mut filled = 0;
        while filled < buf.len() {
            let n = file
                .read(&mut buf[filled..])
                .await
                .map_err(CoordinatorError::io(path))?;
            if n == 0 {
                break;
            }
            filled += n;
        }
        buf.truncate(filled);
        hasher.update(&buf);
        let last = offset + filled as u64 >= size || filled == 0;
        let sha256 = if last {
            keel_proto::checkpoint::hex(&hasher.clone().finalize())
        } else {
            String::new()
        };
        let chunk = FileChunk {
            key: None,
            name: name.to_string(),
            offset,
            data: buf.into(),
            last,
            sha256,
            size,
        };
        offset += filled as u64;
        if tx.send(Ok(chunk)).await.is_err() {
            return Ok(());
        }
        if last {
            return Ok(());
        }
    }
}
