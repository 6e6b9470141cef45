//! Files over gRPC as a stream of [`FileChunk`]s: the one sender and the one receiver that
//! every transfer uses (the coordinator's downloads, the worker's checkpoint upload, the
//! coordinator's checkpoint store, the worker's file cache and `keel pull`).
//!
//! # Wire format
//! A stream carries files one after another. Each file is cut into chunks of
//! [`FILE_CHUNK_BYTES`] (the last one shorter; an empty file is one empty chunk). Every chunk
//! carries the file's `name`, its byte `offset` in the file and the file's whole `size`; the
//! last chunk of a file has `last` set and the sha256 of the whole file (lowercase hex) in
//! `sha256`. Upload chunks also carry the sender's `key`.
//!
//! # Receiving
//! [`Receiver`] writes each file as its chunks arrive, checks that every chunk continues where
//! the previous one ended and that a file ends with its `last` chunk before the next begins,
//! fsyncs the file and verifies its sha256. What a file may be called, how large it may grow
//! and who may send it is the caller's policy, checked before [`Receiver::accept`].

use crate::checkpoint::hex;
use crate::protocol::FILE_CHUNK_BYTES;
use crate::rpc::{FileChunk, TrainingKey};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// gRPC metadata key set (to `1`) on a checkpoint upload refused because the coordinator's
/// data folder has no room for it (`RESOURCE_EXHAUSTED`): a periodic checkpoint is not tried
/// again at once (the next one will be), the final one is tried again until it is stored.
pub const DISK_FULL_METADATA: &str = "keel-disk-full";

/// Errors sending or receiving a file stream.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// A local file could not be opened, read, written or synced.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A received file's bytes do not hash to the sha256 its last chunk carries.
    #[error("{name}: received sha256 {got}, expected {expected}")]
    Checksum {
        /// The file's name in the stream.
        name: String,
        /// Where it was written.
        path: PathBuf,
        /// The sha256 the sender promised (hex).
        expected: String,
        /// The sha256 of the bytes received (hex).
        got: String,
    },
    /// The stream broke the chunk protocol: a chunk at the wrong offset, a file left without
    /// its last chunk, a stream that ended in the middle of a file.
    #[error("{0}")]
    Protocol(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TransferError + '_ {
    move |source| TransferError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Sends the files `(name, path)` one after another as chunks on `tx`, each wrapped by `wrap`
/// (`Ok` for a gRPC response stream, say), tagged with `key` when given. Returns early,
/// without error, when the receiving side hangs up.
///
/// Errors: [`TransferError::Io`] naming the file that cannot be opened or read; the chunks
/// sent before it stay sent.
pub async fn send_files<T>(
    files: &[(String, PathBuf)],
    key: Option<&TrainingKey>,
    tx: &mpsc::Sender<T>,
    wrap: impl Fn(FileChunk) -> T,
) -> Result<(), TransferError> {
    for (name, path) in files {
        if !send_file(name, path, key, tx, &wrap).await? {
            return Ok(());
        }
    }
    Ok(())
}

/// Sends one file; returns whether the receiver is still there.
async fn send_file<T>(
    name: &str,
    path: &Path,
    key: Option<&TrainingKey>,
    tx: &mpsc::Sender<T>,
    wrap: &impl Fn(FileChunk) -> T,
) -> Result<bool, TransferError> {
    let mut file = tokio::fs::File::open(path).await.map_err(io(path))?;
    let size = file.metadata().await.map_err(io(path))?.len();
    let mut hasher = Sha256::new();
    let mut offset = 0u64;
    loop {
        let mut data = Vec::with_capacity(FILE_CHUNK_BYTES);
        (&mut file)
            .take(FILE_CHUNK_BYTES as u64)
            .read_to_end(&mut data)
            .await
            .map_err(io(path))?;
        hasher.update(&data);
        let filled = data.len() as u64;
        let last = offset + filled >= size || filled == 0;
        let chunk = FileChunk {
            key: key.cloned(),
            name: name.to_string(),
            offset,
            data: data.into(),
            last,
            sha256: if last {
                hex(&hasher.clone().finalize())
            } else {
                String::new()
            },
            size,
        };
        offset += filled;
        if tx.send(wrap(chunk)).await.is_err() {
            return Ok(false);
        }
        if last {
            return Ok(true);
        }
    }
}

/// A whole file of at most [`FILE_CHUNK_BYTES`] as its one chunk (`last`, with its sha256), as
/// [`send_files`] would send it; for small files and tests.
pub fn whole_file_chunk(name: &str, data: &[u8], key: Option<TrainingKey>) -> FileChunk {
    FileChunk {
        key,
        name: name.to_string(),
        offset: 0,
        data: data.to_vec().into(),
        last: true,
        sha256: crate::checkpoint::sha256_hex(data),
        size: data.len() as u64,
    }
}

/// Where a [`Receiver`] writes.
#[derive(Debug, Clone)]
enum Target {
    /// Each file at `dir/<name>` (the caller checks names).
    Dir(PathBuf),
    /// The stream's one file at this path, whatever its name.
    File(PathBuf),
}

/// A file being received.
struct Incoming {
    name: String,
    path: PathBuf,
    file: tokio::fs::File,
    hasher: Sha256,
    written: u64,
}

/// A file received whole and verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedFile {
    /// Its name in the stream.
    pub name: String,
    /// Where it was written.
    pub path: PathBuf,
    /// Its size in bytes.
    pub size: u64,
    /// Its sha256 (hex), verified against the sender's.
    pub sha256: String,
}

/// Writes the files of one chunk stream: see the module documentation.
pub struct Receiver {
    target: Target,
    current: Option<Incoming>,
    received: Vec<ReceivedFile>,
}

impl Receiver {
    /// A receiver writing each file to `dir/<name>`. The caller checks each name (with
    /// [`crate::checkpoint::check_plain_name`]) before [`Receiver::accept`].
    pub fn into_dir(dir: impl Into<PathBuf>) -> Receiver {
        Receiver {
            target: Target::Dir(dir.into()),
            current: None,
            received: Vec::new(),
        }
    }

    /// A receiver for a stream of one file, written to `path` (created or truncated).
    pub fn into_file(path: impl Into<PathBuf>) -> Receiver {
        Receiver {
            target: Target::File(path.into()),
            current: None,
            received: Vec::new(),
        }
    }

    /// The name of the file in progress, if one is.
    pub fn current(&self) -> Option<&str> {
        self.current.as_ref().map(|c| c.name.as_str())
    }

    /// Bytes written so far of the file in progress (0 between files).
    pub fn written(&self) -> u64 {
        self.current.as_ref().map_or(0, |c| c.written)
    }

    /// The files received whole so far, in order.
    pub fn received(&self) -> &[ReceivedFile] {
        &self.received
    }

    /// Whether `chunk` starts a new file (no file is in progress, or another one is).
    pub fn starts_file(&self, chunk: &FileChunk) -> bool {
        self.current().is_none_or(|n| n != chunk.name)
    }

    /// Writes one chunk. Returns the file it completed (its `last` chunk: then the file is
    /// fsynced and its sha256 verified), if it did.
    ///
    /// Errors: [`TransferError::Protocol`] for a chunk of a new file while another lacks its
    /// last chunk, a chunk at another offset than the bytes written so far, or a second file
    /// in a single-file stream; [`TransferError::Checksum`]; [`TransferError::Io`].
    pub async fn accept(
        &mut self,
        chunk: FileChunk,
    ) -> Result<Option<ReceivedFile>, TransferError> {
        if self.starts_file(&chunk) {
            if let Some(c) = &self.current {
                return Err(TransferError::Protocol(format!(
                    "{}: the stream moved on to {} before its last chunk",
                    c.name, chunk.name
                )));
            }
            let path = match &self.target {
                Target::Dir(dir) => dir.join(&chunk.name),
                Target::File(path) if self.received.is_empty() => path.clone(),
                Target::File(_) => {
                    return Err(TransferError::Protocol(format!(
                        "{}: a second file in a stream of one",
                        chunk.name
                    )));
                }
            };
            let file = tokio::fs::File::create(&path).await.map_err(io(&path))?;
            self.current = Some(Incoming {
                name: chunk.name.clone(),
                path,
                file,
                hasher: Sha256::new(),
                written: 0,
            });
        }
        let Some(c) = self.current.as_mut() else {
            return Ok(None);
        };
        if chunk.offset != c.written {
            return Err(TransferError::Protocol(format!(
                "{}: chunk at offset {} after {} bytes",
                c.name, chunk.offset, c.written
            )));
        }
        c.file.write_all(&chunk.data).await.map_err(io(&c.path))?;
        c.hasher.update(&chunk.data);
        c.written += chunk.data.len() as u64;
        if !chunk.last {
            return Ok(None);
        }
        let Some(c) = self.current.take() else {
            return Ok(None);
        };
        let Incoming {
            name,
            path,
            mut file,
            hasher,
            written,
        } = c;
        file.flush().await.map_err(io(&path))?;
        file.sync_all().await.map_err(io(&path))?;
        let got = hex(&hasher.finalize());
        if got != chunk.sha256 {
            return Err(TransferError::Checksum {
                name,
                path,
                expected: chunk.sha256,
                got,
            });
        }
        let done = ReceivedFile {
            name,
            path,
            size: written,
            sha256: got,
        };
        self.received.push(done.clone());
        Ok(Some(done))
    }

    /// Ends the stream. Returns the files received.
    ///
    /// Errors: [`TransferError::Protocol`] when the stream ended in the middle of a file.
    pub fn finish(self) -> Result<Vec<ReceivedFile>, TransferError> {
        if let Some(c) = self.current {
            return Err(TransferError::Protocol(format!(
                "{}: the stream ended after {} bytes, before its last chunk",
                c.name, c.written
            )));
        }
        Ok(self.received)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn sent(files: &[(String, PathBuf)]) -> Vec<FileChunk> {
        let (tx, mut rx) = mpsc::channel(1024);
        send_files(files, None, &tx, |c| c).await.unwrap();
        drop(tx);
        let mut out = Vec::new();
        while let Some(c) = rx.recv().await {
            out.push(c);
        }
        out
    }

    #[tokio::test]
    async fn files_go_in_full_chunks_and_come_back_verified() {
        let src = tempfile::tempdir().unwrap();
        let big: Vec<u8> = (0..FILE_CHUNK_BYTES * 2 + 5).map(|i| i as u8).collect();
        std::fs::write(src.path().join("big.bin"), &big).unwrap();
        std::fs::write(src.path().join("empty"), b"").unwrap();
        let files = vec![
            ("big.bin".to_string(), src.path().join("big.bin")),
            ("empty".to_string(), src.path().join("empty")),
        ];
        let chunks = sent(&files).await;
        let shape: Vec<(&str, u64, usize, bool)> = chunks
            .iter()
            .map(|c| (c.name.as_str(), c.offset, c.data.len(), c.last))
            .collect();
        let m = FILE_CHUNK_BYTES;
        assert_eq!(
            shape,
            [
                ("big.bin", 0, m, false),
                ("big.bin", m as u64, m, false),
                ("big.bin", 2 * m as u64, 5, true),
                ("empty", 0, 0, true),
            ]
        );
        assert_eq!(chunks[2].sha256, crate::checkpoint::sha256_hex(&big));
        assert!(chunks[0].sha256.is_empty());
        assert!(chunks[..3].iter().all(|c| c.size == big.len() as u64));
        let dst = tempfile::tempdir().unwrap();
        let mut rx = Receiver::into_dir(dst.path());
        for c in chunks {
            rx.accept(c).await.unwrap();
        }
        let got = rx.finish().unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(std::fs::read(dst.path().join("big.bin")).unwrap(), big);
        assert_eq!(got[1].size, 0);
    }

    #[tokio::test]
    async fn bad_offsets_checksums_and_unfinished_files_are_named() {
        let src = tempfile::tempdir().unwrap();
        let data = vec![7u8; FILE_CHUNK_BYTES + 1];
        std::fs::write(src.path().join("a.bin"), &data).unwrap();
        let files = vec![("a.bin".to_string(), src.path().join("a.bin"))];
        let chunks = sent(&files).await;
        let dst = tempfile::tempdir().unwrap();

        let mut rx = Receiver::into_dir(dst.path());
        let err = rx.accept(chunks[1].clone()).await.unwrap_err().to_string();
        assert!(
            err.contains("a.bin: chunk at offset 1048576 after 0 bytes"),
            "{err}"
        );

        let mut rx = Receiver::into_dir(dst.path());
        rx.accept(chunks[0].clone()).await.unwrap();
        let mut bad = chunks[1].clone();
        bad.sha256 = "00".repeat(32);
        let err = rx.accept(bad).await.unwrap_err();
        assert!(matches!(&err, TransferError::Checksum { name, .. } if name == "a.bin"));
        assert!(err.to_string().contains(&"00".repeat(32)), "{err}");

        let mut rx = Receiver::into_dir(dst.path());
        rx.accept(chunks[0].clone()).await.unwrap();
        let err = rx.finish().unwrap_err().to_string();
        assert!(
            err.contains("a.bin: the stream ended after 1048576 bytes"),
            "{err}"
        );

        let mut rx = Receiver::into_file(dst.path().join("one"));
        rx.accept(chunks[0].clone()).await.unwrap();
        let mut other = chunks[0].clone();
        other.name = "b.bin".into();
        let err = rx.accept(other).await.unwrap_err().to_string();
        assert!(err.contains("a.bin: the stream moved on to b.bin"), "{err}");
    }

    #[tokio::test]
    async fn a_missing_file_is_an_io_error_naming_it() {
        let (tx, _rx) = mpsc::channel(4);
        let files = vec![("x".to_string(), PathBuf::from("/nonexistent/keel/x"))];
        let err = send_files(&files, None, &tx, |c| c).await.unwrap_err();
        assert!(err.to_string().contains("/nonexistent/keel/x"), "{err}");
    }
}
