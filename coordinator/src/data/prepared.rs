//! A prepared folder opened for training: the manifest, the tokenizer, and access to shards.

use std::path::{Path, PathBuf};

use keel_proto::shard::{Sequence, ShardReader};
use keel_proto::tokenizer::{KeelTokenizer, hex};

use super::manifest::{PreparedManifest, ShardEntry};
use super::prepare::{MANIFEST_FILE, PrepareError};

/// A folder written by [`super::prepare`](fn@super::prepare): `manifest.json`, tokenizer files, shards.
#[derive(Debug, Clone)]
pub struct PreparedData {
    /// The folder.
    dir: PathBuf,
    /// Its manifest.
    manifest: PreparedManifest,
    /// Its tokenizer (from `tokenizer.json`).
    tokenizer: KeelTokenizer,
}

impl PreparedData {
    /// Opens `dir`: reads `manifest.json`, loads `tokenizer.json`, checks that the tokenizer's
    /// vocabulary hash is the manifest's and that every shard file exists. Shards themselves
    /// are verified when opened ([`Self::open_shard`]).
    ///
    /// Errors: `Io`, `BadManifest`, `Tokenizer`, `ShardMismatch`.
    pub fn open(dir: &Path) -> Result<PreparedData, PrepareError> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(|source| PrepareError::Io {
            path: path.clone(),
            source,
        })?;
        let manifest: PreparedManifest =
            serde_json::from_str(&text).map_err(|e| PrepareError::BadManifest {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        let tokenizer = KeelTokenizer::from_tokenizer_json(&dir.join("tokenizer.json"))?;
        if tokenizer.vocab_hash_hex() != manifest.vocab_hash {
            return Err(PrepareError::BadManifest {
                path,
                reason: format!(
                    "tokenizer.json's vocabulary hashes to {}, the manifest says {}",
                    tokenizer.vocab_hash_hex(),
                    manifest.vocab_hash
                ),
            });
        }
        let mut expected_first = 0;
        for entry in &manifest.shards {
            if entry.first_global_index != expected_first {
                return Err(PrepareError::BadManifest {
                    path,
                    reason: format!(
                        "{} starts at global index {}, expected {expected_first}",
                        entry.file, entry.first_global_index
                    ),
                });
            }
            expected_first += entry.sequences;
        }
        if expected_first != manifest.total_sequences {
            return Err(PrepareError::BadManifest {
                path,
                reason: format!(
                    "shards hold {expected_first} sequences, total_sequences says {}",
                    manifest.total_sequences
                ),
            });
        }
        for entry in manifest
            .shards
            .iter()
            .chain(std::iter::once(&manifest.heldout))
        {
            let p = dir.join(&entry.file);
            if !p.is_file() {
                return Err(PrepareError::ShardMismatch {
                    path: p,
                    reason: "listed in manifest.json but missing".into(),
                });
            }
        }
        Ok(PreparedData {
            dir: dir.to_path_buf(),
            manifest,
            tokenizer,
        })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &PreparedManifest {
        &self.manifest
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &KeelTokenizer {
        &self.tokenizer
    }

    /// Training sequences `N` (global indices `0..N`).
    pub fn total_sequences(&self) -> u64 {
        self.manifest.total_sequences
    }

    /// Number of training shards.
    pub fn num_shards(&self) -> usize {
        self.manifest.shards.len()
    }

    /// Path of training shard `i` (`None` past the end).
    pub fn shard_path(&self, i: usize) -> Option<PathBuf> {
        self.manifest.shards.get(i).map(|e| self.dir.join(&e.file))
    }

    /// Path of the heldout shard.
    pub fn heldout_path(&self) -> PathBuf {
        self.dir.join(&self.manifest.heldout.file)
    }

    /// The training shard holding global index `g`, `None` if `g >= N`.
    pub fn shard_of(&self, g: u64) -> Option<usize> {
        if g >= self.manifest.total_sequences {
            return None;
        }
        let k = self
            .manifest
            .shards
            .partition_point(|e| e.first_global_index <= g);
        k.checked_sub(1)
    }

    fn open_entry(&self, entry: &ShardEntry) -> Result<ShardReader, PrepareError> {
        let path = self.dir.join(&entry.file);
        let reader = ShardReader::open(&path)?;
        if hex(&reader.vocab_hash()) != self.manifest.vocab_hash {
            return Err(PrepareError::ShardMismatch {
                path,
                reason: format!(
                    "written for vocabulary {}, the manifest's is {}",
                    hex(&reader.vocab_hash()),
                    self.manifest.vocab_hash
                ),
            });
        }
        if reader.checksum() != entry.checksum || reader.len() as u64 != entry.sequences {
            return Err(PrepareError::ShardMismatch {
                path,
                reason: format!(
                    "checksum {:08x} / {} sequences, the manifest says {:08x} / {}",
                    reader.checksum(),
                    reader.len(),
                    entry.checksum,
                    entry.sequences
                ),
            });
        }
        Ok(reader)
    }

    /// Opens and verifies training shard `i` (checksums, vocabulary, manifest agreement).
    ///
    /// Errors: `Shard` (truncated/corrupted file), `ShardMismatch`, `InvalidOption` for `i`
    /// out of range.
    pub fn open_shard(&self, i: usize) -> Result<ShardReader, PrepareError> {
        let entry = self
            .manifest
            .shards
            .get(i)
            .ok_or_else(|| PrepareError::InvalidOption {
                field: "shard",
                reason: format!("{i} is out of range (0..{})", self.manifest.shards.len()),
            })?;
        self.open_entry(entry)
    }

    /// Opens and verifies the heldout shard. Errors: as [`Self::open_shard`].
    pub fn open_heldout(&self) -> Result<ShardReader, PrepareError> {
        self.open_entry(&self.manifest.heldout)
    }

    /// Reads training sequence `g` (opens its shard: use [`super::build_worker_shard`] for
    /// bulk access). Errors: `InvalidOption` for `g >= N`, shard errors.
    pub fn sequence(&self, g: u64) -> Result<Sequence, PrepareError> {
        let k = self
            .shard_of(g)
            .ok_or_else(|| PrepareError::InvalidOption {
                field: "global_index",
                reason: format!("{g} is out of range (0..{})", self.manifest.total_sequences),
            })?;
        let reader = self.open_shard(k)?;
        let pos = (g - self.manifest.shards[k].first_global_index) as usize;
        Ok(reader.get(pos)?)
    }
}
