//! The checkpoint folder: Hugging Face layout plus what resuming needs.
//!
//! # Layout
//! A checkpoint is one folder, loadable by `BertForMaskedLM.from_pretrained(DIR)` and
//! `AutoTokenizer.from_pretrained(DIR)` as it is:
//! - `config.json`, `model.safetensors` (HF names, float32, tied decoder not stored);
//! - `vocab.txt`, `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`;
//! - `optimizer.safetensors` (the optimizer's moments, same flat layout as the weights);
//! - `trainer_state.json` ([`TrainerState`]: step, data position, seed);
//! - `manifest.json` ([`Manifest`]: sha256 of every other file).
//!
//! Folders are written under a temporary name in the same parent, every file fsynced, then
//! renamed into place ([`commit_dir`]), so a reader never sees half a checkpoint.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// `model.safetensors`: the weights (HF state-dict names).
pub const MODEL_FILE: &str = "model.safetensors";
/// `optimizer.safetensors`: the optimizer state.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// `trainer_state.json`: [`TrainerState`].
pub const TRAINER_STATE_FILE: &str = "trainer_state.json";
/// `manifest.json`: [`Manifest`].
pub const MANIFEST_FILE: &str = "manifest.json";
/// `config.json`: the HF model config.
pub const CONFIG_FILE: &str = "config.json";

/// Errors reading or writing checkpoint folders.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file could not be read within Keel's bounds (not a regular file, too large).
    #[error(transparent)]
    Limit(#[from] crate::limits::LimitError),
    /// A JSON file did not parse.
    #[error("{path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// A file's content does not match the sha256 the manifest or sender gave.
    #[error("{path}: sha256 is {got}, expected {expected}")]
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
        /// The checksum promised (hex).
        expected: String,
        /// The checksum of the bytes on disk (hex).
        got: String,
    },
    /// A file has another size than the manifest records (truncated or grown).
    #[error(
        "{path}: {got} bytes, but manifest.json records {expected}: the file was truncated or altered"
    )]
    SizeMismatch {
        /// The file.
        path: PathBuf,
        /// Size the manifest records, bytes.
        expected: u64,
        /// Size on disk, bytes.
        got: u64,
    },
    /// A file the manifest lists is not in the folder.
    #[error("{path}: listed in manifest.json but missing from the folder")]
    MissingFile {
        /// The file.
        path: PathBuf,
    },
    /// A file name was not a plain name (it had a directory part or was empty).
    #[error("invalid file name {name:?} in a checkpoint: expected a plain file name")]
    BadName {
        /// The rejected name.
        name: String,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Where training stands in a checkpoint, for resuming and for people.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub step: u64,
    /// The job this checkpoint belongs to.
    pub job_id: String,
    /// Membership generation that wrote it.
    pub generation: u64,
    /// The job seed (init, masking and dropout streams derive from it).
    pub seed: u64,
    /// World size that wrote it.
    pub world_size: u32,
    /// Global batch size in sequences.
    pub global_batch_size: u64,
    /// Sequences consumed so far (`step * global_batch_size`): the data position.
    pub sequences_seen: u64,
    /// Training loss at this step (global); NaN where none was computed (a checkpoint staged
    /// when a job resumes, before its first step), which JSON writes as `null`.
    #[serde(deserialize_with = "null_as_nan")]
    pub loss: f64,
    /// The optimizer name (`adamw` or `lamb`).
    pub optimizer: String,
    /// Steps whose update was skipped (non-finite loss or gradient) up to here.
    #[serde(default)]
    pub skipped_steps: u64,
    /// GEMM precision the job ran in (`fp32` or `bf16`, see `crate::precision`); fp32 in
    /// checkpoints written before precisions existed.
    #[serde(default)]
    pub precision: crate::precision::Precision,
}

/// Reads a number, or `null` as NaN: serde_json writes a non-finite f64 as `null`, so a
/// state written with no loss must read back (a resume from such a checkpoint failed with
/// "invalid type: null, expected f64").
fn null_as_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

impl TrainerState {
    /// Reads `trainer_state.json` from a checkpoint folder.
    ///
    /// Errors: [`CheckpointError::Io`], [`CheckpointError::Json`].
    pub fn read(dir: &Path) -> Result<Self, CheckpointError> {
        let path = dir.join(TRAINER_STATE_FILE);
        let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
        serde_json::from_str(&text).map_err(|source| CheckpointError::Json { path, source })
    }
}

/// `manifest.json`: the sha256 (hex) and size of every file of the folder but itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// File name -> sha256 (lowercase hex).
    pub files: BTreeMap<String, String>,
    /// File name -> size in bytes (absent in manifests written before sizes were recorded).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sizes: BTreeMap<String, u64>,
}

impl Manifest {
    /// Computes the manifest of every plain file in `dir` except `manifest.json`.
    ///
    /// Errors: [`CheckpointError::Io`].
    pub fn compute(dir: &Path) -> Result<Self, CheckpointError> {
        let mut files = BTreeMap::new();
        let mut sizes = BTreeMap::new();
        for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
            let entry = entry.map_err(io_err(dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name == MANIFEST_FILE || !entry.path().is_file() {
                continue;
            }
            let size = entry.metadata().map_err(io_err(&entry.path()))?.len();
            files.insert(name.clone(), sha256_file(&entry.path())?);
            sizes.insert(name, size);
        }
        Ok(Self { files, sizes })
    }

    /// Reads `manifest.json` from `dir` (a regular file of at most
    /// [`crate::limits::MAX_RECORD_BYTES`]).
    ///
    /// Errors: [`CheckpointError::Limit`], [`CheckpointError::Json`].
    pub fn read(dir: &Path) -> Result<Self, CheckpointError> {
        let path = dir.join(MANIFEST_FILE);
        let text = crate::limits::read_bounded_to_string(
            &path,
            crate::limits::MAX_RECORD_BYTES,
            "a checkpoint manifest",
        )?;
        serde_json::from_str(&text).map_err(|source| CheckpointError::Json { path, source })
    }

    /// Checks every listed file of `dir` against its size (when recorded) and sha256.
    ///
    /// Errors, each naming the first bad file: [`CheckpointError::BadName`] for a listed name
    /// with a directory part, [`CheckpointError::MissingFile`], [`CheckpointError::SizeMismatch`]
    /// (truncated or grown), [`CheckpointError::ChecksumMismatch`] (altered),
    /// [`CheckpointError::Io`].
    pub fn verify(&self, dir: &Path) -> Result<(), CheckpointError> {
        for (name, expected) in &self.files {
            check_plain_name(name)?;
            let path = dir.join(name);
            let meta = match std::fs::metadata(&path) {
                Ok(meta) => meta,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(CheckpointError::MissingFile { path });
                }
                Err(source) => return Err(CheckpointError::Io { path, source }),
            };
            if let Some(&size) = self.sizes.get(name)
                && meta.len() != size
            {
                return Err(CheckpointError::SizeMismatch {
                    path,
                    expected: size,
                    got: meta.len(),
                });
            }
            let got = sha256_file(&path)?;
            if &got != expected {
                return Err(CheckpointError::ChecksumMismatch {
                    path,
                    expected: expected.clone(),
                    got,
                });
            }
        }
        Ok(())
    }
}

/// Verifies a checkpoint folder before loading it: when it holds a `manifest.json` (every
/// folder Keel writes), every listed file must be present with its size and sha256. A folder
/// without a manifest (one written by `save_pretrained`, say) is accepted as it is: `Ok(None)`.
///
/// Errors: as [`Manifest::read`] and [`Manifest::verify`], naming the file and what differs.
pub fn verify_dir(dir: &Path) -> Result<Option<Manifest>, CheckpointError> {
    if !dir.join(MANIFEST_FILE).is_file() {
        return Ok(None);
    }
    let manifest = Manifest::read(dir)?;
    manifest.verify(dir)?;
    Ok(Some(manifest))
}

/// Rejects names with a directory part, `..`, or nothing in them.
///
/// Errors: [`CheckpointError::BadName`].
pub fn check_plain_name(name: &str) -> Result<(), CheckpointError> {
    let plain = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\\');
    if plain {
        Ok(())
    } else {
        Err(CheckpointError::BadName {
            name: name.to_string(),
        })
    }
}

/// Lowercase hex sha256 of a byte slice.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Lowercase hex sha256 of a file's content, read in 1 MiB pieces.
///
/// Errors: [`CheckpointError::Io`].
pub fn sha256_file(path: &Path) -> Result<String, CheckpointError> {
    let mut file = File::open(path).map_err(io_err(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Lowercase hex of `bytes` (a sha256 digest, 64 characters), as manifests and file streams carry it.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `bytes` to `path` atomically, mode 0600, with [`crate::atomic::write_atomic`]
/// (temporary file, fsync, rename, fsync of the folder).
///
/// Errors: [`CheckpointError::Io`].
pub fn write_file_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    crate::atomic::write_atomic(path, bytes, crate::atomic::Access::Owner).map_err(Into::into)
}

impl From<crate::atomic::AtomicWriteError> for CheckpointError {
    fn from(e: crate::atomic::AtomicWriteError) -> Self {
        CheckpointError::Io {
            path: e.path,
            source: e.source,
        }
    }
}

/// Finishes a folder written under a temporary name: writes its `manifest.json`, fsyncs every
/// file and the folder, and renames `tmp_dir` to `final_dir` (replacing an older one).
/// Returns the manifest.
///
/// Errors: [`CheckpointError::Io`].
pub fn commit_dir(tmp_dir: &Path, final_dir: &Path) -> Result<Manifest, CheckpointError> {
    let manifest = Manifest::compute(tmp_dir)?;
    let text = serde_json::to_string_pretty(&manifest).map_err(|source| CheckpointError::Json {
        path: tmp_dir.join(MANIFEST_FILE),
        source,
    })?;
    write_file_atomic(&tmp_dir.join(MANIFEST_FILE), text.as_bytes())?;
    for name in manifest.files.keys() {
        let path = tmp_dir.join(name);
        File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(io_err(&path))?;
    }
    sync_dir(tmp_dir)?;
    if final_dir.exists() {
        std::fs::remove_dir_all(final_dir).map_err(io_err(final_dir))?;
    }
    std::fs::rename(tmp_dir, final_dir).map_err(io_err(final_dir))?;
    if let Some(parent) = final_dir.parent() {
        sync_dir(parent)?;
    }
    Ok(manifest)
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    Ok(crate::atomic::sync_dir(dir)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state a resuming job stages before its first step has no loss (NaN, written as
    /// `null`); a later resume from that checkpoint must read it. Found by
    /// `cli/tests/recovery.rs` under load: "invalid type: null, expected f64 at line 9".
    #[test]
    fn a_state_without_a_loss_reads_back() {
        let state = TrainerState {
            step: 10,
            job_id: "job-2".into(),
            generation: 3,
            seed: 42,
            world_size: 3,
            global_batch_size: 12,
            sequences_seen: 120,
            loss: f64::NAN,
            optimizer: "adamw".into(),
            skipped_steps: 0,
            precision: crate::precision::Precision::Fp32,
        };
        let text = serde_json::to_string_pretty(&state).unwrap();
        assert!(text.contains("\"loss\": null"), "{text}");
        let back: TrainerState = serde_json::from_str(&text).unwrap();
        assert!(back.loss.is_nan());
        assert_eq!(back.step, 10);
        let finite: TrainerState =
            serde_json::from_str(&text.replace("\"loss\": null", "\"loss\": 5.5")).unwrap();
        assert_eq!(finite.loss, 5.5);
    }

    #[test]
    fn commit_dir_writes_a_manifest_that_verifies_and_catches_corruption() {
        let root = tempfile::tempdir().unwrap();
        let tmp = root.path().join(".tmp-step-5");
        std::fs::create_dir(&tmp).unwrap();
        write_file_atomic(&tmp.join("a.bin"), b"hello").unwrap();
        write_file_atomic(&tmp.join("b.json"), b"{}").unwrap();
        let dest = root.path().join("step-5");
        let manifest = commit_dir(&tmp, &dest).unwrap();
        assert!(!tmp.exists());
        assert_eq!(manifest.files.len(), 2);
        assert_eq!(manifest.files["a.bin"], sha256_hex(b"hello"));
        let read = Manifest::read(&dest).unwrap();
        assert_eq!(read, manifest);
        read.verify(&dest).unwrap();
        std::fs::write(dest.join("a.bin"), b"hellO").unwrap();
        let err = read.verify(&dest).unwrap_err();
        assert!(
            matches!(err, CheckpointError::ChecksumMismatch { .. }),
            "{err}"
        );
    }

    /// A committed folder, as Keel writes checkpoints.
    fn committed(root: &Path) -> PathBuf {
        let tmp = root.join(".tmp");
        std::fs::create_dir(&tmp).unwrap();
        write_file_atomic(&tmp.join(MODEL_FILE), &[7u8; 4096]).unwrap();
        write_file_atomic(&tmp.join(CONFIG_FILE), b"{}").unwrap();
        let dest = root.join("ckpt");
        commit_dir(&tmp, &dest).unwrap();
        dest
    }

    #[test]
    fn verify_dir_refuses_truncated_altered_and_missing_files_naming_them() {
        let root = tempfile::tempdir().unwrap();
        let dir = committed(root.path());
        assert!(verify_dir(&dir).unwrap().is_some());

        let model = dir.join(MODEL_FILE);
        std::fs::write(&model, [7u8; 1000]).unwrap();
        let err = verify_dir(&dir).unwrap_err();
        assert!(
            matches!(
                err,
                CheckpointError::SizeMismatch {
                    expected: 4096,
                    got: 1000,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("model.safetensors"), "{err}");
        assert!(err.to_string().contains("truncated"), "{err}");

        let mut bytes = vec![7u8; 4096];
        bytes[100] ^= 1;
        std::fs::write(&model, &bytes).unwrap();
        let err = verify_dir(&dir).unwrap_err();
        assert!(
            matches!(err, CheckpointError::ChecksumMismatch { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("model.safetensors"), "{err}");

        std::fs::remove_file(&model).unwrap();
        let err = verify_dir(&dir).unwrap_err();
        assert!(matches!(err, CheckpointError::MissingFile { .. }), "{err}");
        assert!(err.to_string().contains("model.safetensors"), "{err}");
    }

    #[test]
    fn verify_dir_accepts_a_folder_without_manifest_and_refuses_escaping_names() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join(MODEL_FILE), b"x").unwrap();
        assert!(verify_dir(root.path()).unwrap().is_none());
        let manifest = r#"{"files": {"../outside": "00"}}"#;
        std::fs::write(root.path().join(MANIFEST_FILE), manifest).unwrap();
        let err = verify_dir(root.path()).unwrap_err();
        assert!(matches!(err, CheckpointError::BadName { .. }), "{err}");
    }

    #[test]
    fn plain_names_only() {
        check_plain_name("model.safetensors").unwrap();
        for bad in ["", "..", "a/b", "../x", "a\\b"] {
            assert!(check_plain_name(bad).is_err(), "{bad:?}");
        }
    }
}
