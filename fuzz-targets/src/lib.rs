//! Keel's fuzz targets: one function per decoder of outside bytes, each `fn(&[u8])`, which
//! feeds the bytes to the project's own decoder or validator and must never panic (an error
//! is the expected answer to junk).
//!
//! The cargo-fuzz project in `fuzz/` (nightly, libFuzzer) calls each target; `tests/replay.rs`
//! runs every committed input of `fuzz/corpus/NAME/` through it on stable, in `cargo test`.
//!
//! Targets:
//! - [`ring_frame`]: `Ring/Stream` bytes through the worker's ring service into a mailbox
//!   that joined a small ring.
//! - [`control_request`]: coordinator request messages, decoded and applied as the service
//!   applies them, to the coordinator's state machine.
//! - [`shard`]: the shard reader.
//! - [`checkpoint`]: a checkpoint folder (manifest, config, safetensors) as the coordinator
//!   checks `model.init_checkpoint`.
//! - [`job_toml`]: job files.
//! - [`vocab`]: `vocab.txt` and `tokenizer.json`.
//! - [`corpus`]: corpus files (text, gzip, JSON Lines) through the corpus reader.

#![warn(missing_docs)]

mod checkpoint;
mod control;
mod corpus;
mod ring;
mod shard;
mod text;

pub use checkpoint::checkpoint;
pub use control::{
    CORPUS_FILE as CONTROL_CORPUS_FILE, control_request, input_root as control_input_root,
};
pub use corpus::corpus;
pub use ring::{GENERATION as RING_GENERATION, JOB_ID as RING_JOB_ID, ring_frame};
pub use shard::shard;
pub use text::{job_toml, vocab};

/// A fuzz target: takes any bytes, must not panic.
pub type Target = fn(&[u8]);

/// Every target by name, as `fuzz/corpus/NAME/` names them.
pub const TARGETS: [(&str, Target); 7] = [
    ("ring_frame", ring_frame),
    ("control_request", control_request),
    ("shard", shard),
    ("checkpoint", checkpoint),
    ("job_toml", job_toml),
    ("vocab", vocab),
    ("corpus", corpus),
];

/// Splits `data` into a length-prefixed part and the rest: the first two bytes (little-endian)
/// give the part's length, cut to what is there.
pub(crate) fn split_prefixed(data: &[u8]) -> (&[u8], &[u8]) {
    if data.len() < 2 {
        return (&[], data);
    }
    let len = usize::from(u16::from_le_bytes([data[0], data[1]]));
    let rest = &data[2..];
    rest.split_at(len.min(rest.len()))
}

/// A fresh temporary folder (the targets that read files write the input there).
pub(crate) fn temp_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("keel-fuzz-")
        .tempdir()
        .expect("a temporary folder")
}
