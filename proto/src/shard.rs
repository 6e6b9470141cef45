//! The binary shard format: tokenised training sequences, as `keel prepare` writes them and the
//! coordinator streams them to workers.
//!
//! A shard is one file, little-endian throughout:
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `KEELSHRD` |
//! | 8..12 | format version (u32, currently 1) |
//! | 12..16 | flags (u32): bit 0 = token ids stored as u32 (else u16), bit 1 = NSP labels present |
//! | 16..48 | SHA-256 of the vocabulary (`vocab.txt` bytes) the ids refer to |
//! | 48..56 | number of sequences `n` (u64) |
//! | 56..64 | number of tokens (u64, `[CLS]`/`[SEP]` included) |
//! | 64..72 | payload length in bytes (u64) |
//! | 72..76 | CRC-32C of the payload (u32) |
//! | 76..80 | CRC-32C of bytes 0..76 (u32) |
//! | 80.. | payload: all token ids back to back (u16 or u32 each), then `n` records of 40 bytes |
//!
//! A record: token offset (u64, in tokens), global sequence index (u64), source index (u64:
//! the sequence's position in corpus order before shuffling), length in tokens (u32), start of
//! segment B (u32; `length` when there is none), NSP label (u32; `u32::MAX` = none), reserved
//! (u32, zero). Token type ids are not stored: they are 0 before segment B and 1 from it on.
//!
//! # Layout
//! - [`Sequence`]: one sequence as the rest of Keel sees it.
//! - [`ShardWriter`]: streams sequences into a temporary file, then fsyncs and renames it.
//! - [`ShardReader`]: opens and verifies a shard (magic, version, length, both checksums).
//! - [`ShardError`]: what can go wrong, with the file named.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// File magic of a shard.
pub const SHARD_MAGIC: [u8; 8] = *b"KEELSHRD";
/// Format version this code writes and reads.
pub const SHARD_VERSION: u32 = 1;
/// Header size in bytes.
pub const HEADER_LEN: usize = 80;
/// Size of one per-sequence record in bytes.
pub const RECORD_LEN: usize = 40;

const FLAG_WIDE_IDS: u32 = 1;
const FLAG_NSP: u32 = 2;
const NO_NSP: u32 = u32::MAX;

/// One training sequence: `[CLS] A [SEP]` (MLM) or `[CLS] A [SEP] B [SEP]` (MLM + NSP).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    /// Index of this sequence in the training order (0..N over all training shards, or
    /// 0..H in the heldout shard): keys its dynamic mask, whichever worker holds it.
    pub global_index: u64,
    /// Token ids, `[t]`, including `[CLS]` and `[SEP]`.
    pub ids: Vec<u32>,
    /// Segment ids, `[t]`: 0 for `[CLS] A [SEP]`, 1 for `B [SEP]`.
    pub token_type_ids: Vec<u32>,
    /// NSP label (0 = B follows A, 1 = B is random); `None` for the `mlm` objective.
    pub nsp_label: Option<u32>,
}

/// Errors reading or writing shards. Every variant that concerns a file names it.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// An OS-level read or write failed.
    #[error("{path}: {source}")]
    Io {
        /// The shard file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file does not start with `KEELSHRD`.
    #[error("{path}: not a Keel shard (bad magic bytes)")]
    BadMagic {
        /// The file.
        path: PathBuf,
    },
    /// The file has a format version this build does not read.
    #[error("{path}: shard format version {version}, this build reads version {SHARD_VERSION}")]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version found.
        version: u32,
    },
    /// The file is shorter (or longer) than its header says: truncated or appended to.
    #[error("{path}: shard is {got} bytes, its header says {expected} (truncated or damaged)")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes the header announces.
        expected: u64,
        /// Bytes on disk.
        got: u64,
    },
    /// The header or payload checksum does not match: the file is corrupted.
    #[error(
        "{path}: {part} checksum mismatch (stored {stored:08x}, computed {computed:08x}): shard is corrupted"
    )]
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
        /// `header` or `payload`.
        part: &'static str,
        /// CRC-32C stored in the file.
        stored: u32,
        /// CRC-32C of the bytes read.
        computed: u32,
    },
    /// The checksums match but the content is inconsistent (a bug in the writer).
    #[error("{path}: inconsistent shard: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A sequence handed to the writer is malformed.
    #[error("{path}: cannot write sequence {global_index}: {reason}")]
    InvalidSequence {
        /// The shard being written.
        path: PathBuf,
        /// The sequence's global index.
        global_index: u64,
        /// What is wrong.
        reason: String,
    },
    /// `get(i)` past the end.
    #[error("sequence {index} requested from a shard of {len} sequences")]
    IndexOutOfRange {
        /// The index asked for.
        index: usize,
        /// Sequences in the shard.
        len: usize,
    },
}

/// Writes a shard: sequences stream to a temporary file in the target folder; [`Self::finish`]
/// writes the index and header, fsyncs and renames it to its final name. Memory: 40 bytes per
/// sequence (the index), not the tokens. Dropping an unfinished writer deletes the temporary file.
pub struct ShardWriter {
    /// Final file name.
    path: PathBuf,
    /// Buffered writer over the temporary file.
    out: BufWriter<tempfile::NamedTempFile>,
    /// Vocabulary hash written to the header.
    vocab_hash: [u8; 32],
    /// Token ids as u32 (vocabulary above 65,536 tokens) rather than u16.
    wide_ids: bool,
    /// Whether sequences carry NSP labels (fixed by the first sequence).
    has_nsp: Option<bool>,
    /// The per-sequence records, written at the end.
    records: Vec<u8>,
    /// Tokens written so far.
    num_tokens: u64,
    /// Sequences written so far.
    num_sequences: u64,
    /// Running CRC-32C of the payload.
    crc: u32,
}

impl ShardWriter {
    /// Starts a shard at `path` for ids of a vocabulary of `vocab_size` tokens (u16 ids when
    /// it is at most 65,536) whose `vocab.txt` hashes to `vocab_hash`.
    ///
    /// Errors: `Io` if the temporary file cannot be created next to `path`.
    pub fn create(
        path: &Path,
        vocab_hash: [u8; 32],
        vocab_size: usize,
    ) -> Result<Self, ShardError> {
        let io = |source| ShardError::Io {
            path: path.to_path_buf(),
            source,
        };
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let tmp = tempfile::Builder::new()
            .prefix(".shard-")
            .suffix(".tmp")
            .tempfile_in(dir)
            .map_err(io)?;
        let mut out = BufWriter::with_capacity(1 << 20, tmp);
        out.write_all(&[0u8; HEADER_LEN]).map_err(io)?;
        Ok(Self {
            path: path.to_path_buf(),
            out,
            vocab_hash,
            wide_ids: vocab_size > 1 << 16,
            has_nsp: None,
            records: Vec::new(),
            num_tokens: 0,
            num_sequences: 0,
            crc: 0,
        })
    }

    /// Appends a sequence. `source_index` is its position in corpus order (kept for
    /// inspection and round-trip checks).
    ///
    /// Errors: `InvalidSequence` (empty, token types not of the form 0..0 1..1, a mix of NSP
    /// and non-NSP sequences, an id too large for u16 storage), `Io`.
    pub fn push(&mut self, seq: &Sequence, source_index: u64) -> Result<(), ShardError> {
        let invalid = |reason: String| ShardError::InvalidSequence {
            path: self.path.clone(),
            global_index: seq.global_index,
            reason,
        };
        if seq.ids.is_empty() {
            return Err(invalid("no tokens".into()));
        }
        if seq.ids.len() != seq.token_type_ids.len() {
            return Err(invalid(format!(
                "{} ids but {} token_type_ids",
                seq.ids.len(),
                seq.token_type_ids.len()
            )));
        }
        let segment_b = seq
            .token_type_ids
            .iter()
            .position(|&t| t != 0)
            .unwrap_or(seq.ids.len());
        if seq.token_type_ids[segment_b..].iter().any(|&t| t != 1) {
            return Err(invalid(
                "token_type_ids must be zeros followed by ones".into(),
            ));
        }
        match self.has_nsp {
            None => self.has_nsp = Some(seq.nsp_label.is_some()),
            Some(h) if h != seq.nsp_label.is_some() => {
                return Err(invalid(
                    "mixes sequences with and without NSP labels".into(),
                ));
            }
            Some(_) => {}
        }
        if seq.nsp_label == Some(NO_NSP) {
            return Err(invalid(format!("NSP label {NO_NSP} is reserved")));
        }
        let len = u32::try_from(seq.ids.len())
            .map_err(|_| invalid(format!("{} tokens is too long", seq.ids.len())))?;
        let mut bytes = Vec::with_capacity(seq.ids.len() * 4);
        if self.wide_ids {
            for &id in &seq.ids {
                bytes.extend_from_slice(&id.to_le_bytes());
            }
        } else {
            for &id in &seq.ids {
                let narrow = u16::try_from(id)
                    .map_err(|_| invalid(format!("id {id} exceeds the u16 range of this shard")))?;
                bytes.extend_from_slice(&narrow.to_le_bytes());
            }
        }
        self.crc = crc32c::crc32c_append(self.crc, &bytes);
        let path = self.path.clone();
        self.out
            .write_all(&bytes)
            .map_err(|source| ShardError::Io {
                path: path.clone(),
                source,
            })?;
        let mut record = [0u8; RECORD_LEN];
        record[0..8].copy_from_slice(&self.num_tokens.to_le_bytes());
        record[8..16].copy_from_slice(&seq.global_index.to_le_bytes());
        record[16..24].copy_from_slice(&source_index.to_le_bytes());
        record[24..28].copy_from_slice(&len.to_le_bytes());
        record[28..32].copy_from_slice(&(segment_b as u32).to_le_bytes());
        record[32..36].copy_from_slice(&seq.nsp_label.unwrap_or(NO_NSP).to_le_bytes());
        self.records.extend_from_slice(&record);
        self.num_tokens += u64::from(len);
        self.num_sequences += 1;
        Ok(())
    }

    /// Sequences written so far.
    pub fn len(&self) -> u64 {
        self.num_sequences
    }

    /// Whether no sequence was written yet.
    pub fn is_empty(&self) -> bool {
        self.num_sequences == 0
    }

    /// Tokens written so far.
    pub fn num_tokens(&self) -> u64 {
        self.num_tokens
    }

    /// Writes the index and header, fsyncs, and renames the file to its final name.
    /// Returns the payload CRC-32C (the shard's checksum).
    ///
    /// Errors: `Io`.
    pub fn finish(mut self) -> Result<u32, ShardError> {
        let path = self.path.clone();
        let io = |source| ShardError::Io {
            path: path.clone(),
            source,
        };
        self.crc = crc32c::crc32c_append(self.crc, &self.records);
        self.out.write_all(&self.records).map_err(io)?;
        let token_bytes = self.num_tokens * if self.wide_ids { 4 } else { 2 };
        let payload_len = token_bytes + self.records.len() as u64;
        let mut flags = 0;
        if self.wide_ids {
            flags |= FLAG_WIDE_IDS;
        }
        if self.has_nsp == Some(true) {
            flags |= FLAG_NSP;
        }
        let mut header = [0u8; HEADER_LEN];
        header[0..8].copy_from_slice(&SHARD_MAGIC);
        header[8..12].copy_from_slice(&SHARD_VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&flags.to_le_bytes());
        header[16..48].copy_from_slice(&self.vocab_hash);
        header[48..56].copy_from_slice(&self.num_sequences.to_le_bytes());
        header[56..64].copy_from_slice(&self.num_tokens.to_le_bytes());
        header[64..72].copy_from_slice(&payload_len.to_le_bytes());
        header[72..76].copy_from_slice(&self.crc.to_le_bytes());
        let header_crc = crc32c::crc32c(&header[0..76]);
        header[76..80].copy_from_slice(&header_crc.to_le_bytes());
        let mut tmp = self.out.into_inner().map_err(|e| io(e.into_error()))?;
        tmp.seek(SeekFrom::Start(0)).map_err(io)?;
        tmp.write_all(&header).map_err(io)?;
        crate::atomic::persist_atomic(tmp, &path, crate::atomic::Access::Everyone)
            .map_err(|e| io(e.source))?;
        Ok(self.crc)
    }
}

/// A verified shard held in memory (the whole file is read once on open).
#[derive(Debug, Clone)]
pub struct ShardReader {
    /// The file it came from (for error messages).
    path: PathBuf,
    /// The file's bytes.
    bytes: Vec<u8>,
    /// Token ids stored as u32.
    wide_ids: bool,
    /// Whether sequences carry NSP labels.
    has_nsp: bool,
    /// Vocabulary hash from the header.
    vocab_hash: [u8; 32],
    /// Number of sequences.
    len: usize,
    /// Number of tokens.
    num_tokens: u64,
    /// Payload CRC-32C.
    checksum: u32,
    /// Byte offset of the record table.
    records_at: usize,
    /// (global index, position) sorted by global index, for [`Self::find_global`].
    by_global: Vec<(u64, usize)>,
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

impl ShardReader {
    /// Opens and verifies a shard: magic, version, header checksum, file length, payload
    /// checksum, and that every record lies inside the token area.
    ///
    /// Errors: `Io`, `BadMagic`, `UnsupportedVersion`, `Truncated`, `ChecksumMismatch`, `Corrupt`.
    pub fn open(path: &Path) -> Result<ShardReader, ShardError> {
        let mut bytes = Vec::new();
        File::open(path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(|source| ShardError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Self::from_bytes(path, bytes)
    }

    /// Verifies and wraps shard bytes already in memory; `path` is used in error messages.
    ///
    /// Errors: as [`Self::open`].
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<ShardReader, ShardError> {
        let p = || path.to_path_buf();
        if bytes.len() < HEADER_LEN {
            if bytes.len() >= 8 && bytes[0..8] != SHARD_MAGIC {
                return Err(ShardError::BadMagic { path: p() });
            }
            return Err(ShardError::Truncated {
                path: p(),
                expected: HEADER_LEN as u64,
                got: bytes.len() as u64,
            });
        }
        if bytes[0..8] != SHARD_MAGIC {
            return Err(ShardError::BadMagic { path: p() });
        }
        let stored_header_crc = read_u32(&bytes, 76);
        let header_crc = crc32c::crc32c(&bytes[0..76]);
        if stored_header_crc != header_crc {
            return Err(ShardError::ChecksumMismatch {
                path: p(),
                part: "header",
                stored: stored_header_crc,
                computed: header_crc,
            });
        }
        let version = read_u32(&bytes, 8);
        if version != SHARD_VERSION {
            return Err(ShardError::UnsupportedVersion { path: p(), version });
        }
        let flags = read_u32(&bytes, 12);
        let wide_ids = flags & FLAG_WIDE_IDS != 0;
        let has_nsp = flags & FLAG_NSP != 0;
        let mut vocab_hash = [0u8; 32];
        vocab_hash.copy_from_slice(&bytes[16..48]);
        let n = read_u64(&bytes, 48);
        let num_tokens = read_u64(&bytes, 56);
        let payload_len = read_u64(&bytes, 64);
        let stored_crc = read_u32(&bytes, 72);
        // A payload length past u64 (a corrupt header) cannot be the file's either: saturate
        // and report it as a length mismatch rather than overflow.
        let expected = (HEADER_LEN as u64).saturating_add(payload_len);
        if bytes.len() as u64 != expected {
            return Err(ShardError::Truncated {
                path: p(),
                expected,
                got: bytes.len() as u64,
            });
        }
        let crc = crc32c::crc32c(&bytes[HEADER_LEN..]);
        if crc != stored_crc {
            return Err(ShardError::ChecksumMismatch {
                path: p(),
                part: "payload",
                stored: stored_crc,
                computed: crc,
            });
        }
        let corrupt = |reason: String| ShardError::Corrupt { path: p(), reason };
        let width: u64 = if wide_ids { 4 } else { 2 };
        let token_bytes = num_tokens
            .checked_mul(width)
            .ok_or_else(|| corrupt("token count overflows".into()))?;
        let record_bytes = n
            .checked_mul(RECORD_LEN as u64)
            .ok_or_else(|| corrupt("sequence count overflows".into()))?;
        if token_bytes.checked_add(record_bytes) != Some(payload_len) {
            return Err(corrupt(format!(
                "payload of {payload_len} bytes does not hold {num_tokens} tokens and {n} records"
            )));
        }
        let len = usize::try_from(n).map_err(|_| corrupt("too many sequences".into()))?;
        let records_at = HEADER_LEN + token_bytes as usize;
        let mut by_global = Vec::with_capacity(len);
        for i in 0..len {
            let r = records_at + i * RECORD_LEN;
            let offset = read_u64(&bytes, r);
            let seq_len = u64::from(read_u32(&bytes, r + 24));
            let segment_b = u64::from(read_u32(&bytes, r + 28));
            // `offset` is read from the file: its end may overflow, which is out of the area too.
            let end = offset.checked_add(seq_len);
            if seq_len == 0 || end.is_none_or(|end| end > num_tokens) || segment_b > seq_len {
                return Err(corrupt(format!("record {i} points outside the token area")));
            }
            by_global.push((read_u64(&bytes, r + 8), i));
        }
        by_global.sort_unstable();
        Ok(ShardReader {
            path: path.to_path_buf(),
            bytes,
            wide_ids,
            has_nsp,
            vocab_hash,
            len,
            num_tokens,
            checksum: stored_crc,
            records_at,
            by_global,
        })
    }

    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the shard holds no sequence.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of tokens (`[CLS]`/`[SEP]` included).
    pub fn num_tokens(&self) -> u64 {
        self.num_tokens
    }

    /// Payload CRC-32C, as stored in the header.
    pub fn checksum(&self) -> u32 {
        self.checksum
    }

    /// SHA-256 of the vocabulary the ids refer to.
    pub fn vocab_hash(&self) -> [u8; 32] {
        self.vocab_hash
    }

    /// Whether sequences carry NSP labels.
    pub fn has_nsp(&self) -> bool {
        self.has_nsp
    }

    /// The file this shard was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The shard's bytes as on disk (what the coordinator streams to a worker).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The `i`-th sequence in file order. Errors: `IndexOutOfRange`.
    pub fn get(&self, i: usize) -> Result<Sequence, ShardError> {
        if i >= self.len {
            return Err(ShardError::IndexOutOfRange {
                index: i,
                len: self.len,
            });
        }
        let r = self.records_at + i * RECORD_LEN;
        let offset = read_u64(&self.bytes, r) as usize;
        let global_index = read_u64(&self.bytes, r + 8);
        let len = read_u32(&self.bytes, r + 24) as usize;
        let segment_b = read_u32(&self.bytes, r + 28) as usize;
        let nsp = read_u32(&self.bytes, r + 32);
        let ids = if self.wide_ids {
            let at = HEADER_LEN + offset * 4;
            (0..len)
                .map(|k| read_u32(&self.bytes, at + 4 * k))
                .collect()
        } else {
            let at = HEADER_LEN + offset * 2;
            self.bytes[at..at + 2 * len]
                .chunks_exact(2)
                .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
                .collect()
        };
        let token_type_ids = (0..len).map(|k| u32::from(k >= segment_b)).collect();
        Ok(Sequence {
            global_index,
            ids,
            token_type_ids,
            nsp_label: (nsp != NO_NSP).then_some(nsp),
        })
    }

    /// The corpus-order position of the `i`-th sequence (before shuffling). Errors:
    /// `IndexOutOfRange`.
    pub fn source_index(&self, i: usize) -> Result<u64, ShardError> {
        if i >= self.len {
            return Err(ShardError::IndexOutOfRange {
                index: i,
                len: self.len,
            });
        }
        Ok(read_u64(&self.bytes, self.records_at + i * RECORD_LEN + 16))
    }

    /// The global index of the `i`-th sequence without decoding it. Errors: `IndexOutOfRange`.
    pub fn global_index(&self, i: usize) -> Result<u64, ShardError> {
        if i >= self.len {
            return Err(ShardError::IndexOutOfRange {
                index: i,
                len: self.len,
            });
        }
        Ok(read_u64(&self.bytes, self.records_at + i * RECORD_LEN + 8))
    }

    /// The sequence with this global index, if the shard holds it.
    pub fn find_global(&self, global_index: u64) -> Option<Sequence> {
        let k = self
            .by_global
            .binary_search_by_key(&global_index, |&(g, _)| g)
            .ok()?;
        self.get(self.by_global[k].1).ok()
    }

    /// Iterates over all sequences in file order.
    pub fn iter(&self) -> impl Iterator<Item = Sequence> + '_ {
        (0..self.len).filter_map(|i| self.get(i).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bytes` with both checksums set right (what the `shard` fuzz target does with its flag).
    fn with_checksums(mut bytes: Vec<u8>) -> Vec<u8> {
        let payload = crc32c::crc32c(&bytes[HEADER_LEN..]);
        bytes[72..76].copy_from_slice(&payload.to_le_bytes());
        let header = crc32c::crc32c(&bytes[..76]);
        bytes[76..80].copy_from_slice(&header.to_le_bytes());
        bytes
    }

    /// The `shard` fuzz target's input (fuzz/corpus/shard/crash-payload-length-overflow) less
    /// its flag byte: a header whose payload length is `u64::MAX`.
    const PAYLOAD_LENGTH_OVERFLOW: [u8; 80] = [
        0x4b, 0x45, 0x45, 0x4c, 0x53, 0x48, 0x52, 0x44, 0x01, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00,
        0x00, 0x04, 0x00, 0x00, 0xff, 0xff, 0x00, 0x00, 0x80, 0x07, 0x07, 0x07, 0x07, 0x07, 0xff,
        0xff, 0xff, 0x00, 0x00, 0x00, 0x00, 0x0b, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x07, 0x07,
        0x07, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x18, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00,
        0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0b, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00,
    ];

    #[test]
    fn a_payload_length_past_u64_is_refused_as_truncated_not_overflowed() {
        let bytes = with_checksums(PAYLOAD_LENGTH_OVERFLOW.to_vec());
        let err = ShardReader::from_bytes(Path::new("x.shard"), bytes).unwrap_err();
        assert!(
            matches!(err, ShardError::Truncated { got: 80, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("x.shard"), "{err}");
    }

    #[test]
    fn a_record_whose_end_overflows_is_refused_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.shard");
        let mut writer = ShardWriter::create(&path, [0u8; 32], 100).unwrap();
        let seq = Sequence {
            global_index: 0,
            ids: vec![2, 10, 3],
            token_type_ids: vec![0, 0, 0],
            nsp_label: None,
        };
        writer.push(&seq, 0).unwrap();
        writer.finish().unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        // Record 0 (after 3 u16 tokens): an offset that wraps to 1 when its length is added.
        let record = HEADER_LEN + 3 * 2;
        bytes[record..record + 8].copy_from_slice(&(u64::MAX - 1).to_le_bytes());
        let bytes = with_checksums(bytes);
        let err = ShardReader::from_bytes(&path, bytes).unwrap_err();
        assert!(
            matches!(err, ShardError::Corrupt { ref reason, .. } if reason.contains("record 0")),
            "{err}"
        );
    }
}
