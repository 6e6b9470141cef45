//! Per-rank shards: the sequences one rank needs, cut from the prepared shards, which the
//! coordinator then streams to that worker.

use std::path::Path;

use keel_proto::shard::{ShardReader, ShardWriter};
use keel_proto::split::WorkerPlan;

use super::manifest::ShardEntry;
use super::prepare::PrepareError;
use super::prepared::PreparedData;

/// Writes to `out_path` a shard holding exactly the training sequences `plan` assigns to its
/// rank for an epoch (`plan.sequence_indices()`, ascending, each with its global index), read
/// from the prepared shards one at a time. Memory: one prepared shard.
///
/// Errors: `InvalidOption` if the plan's `N` is not the manifest's, shard read/write errors.
pub fn build_worker_shard(
    prepared: &PreparedData,
    plan: &WorkerPlan,
    out_path: &Path,
) -> Result<ShardEntry, PrepareError> {
    if plan.total_sequences() != prepared.total_sequences() {
        return Err(PrepareError::InvalidOption {
            field: "plan",
            reason: format!(
                "plan is for {} sequences, the prepared data has {}",
                plan.total_sequences(),
                prepared.total_sequences()
            ),
        });
    }
    let tokenizer = prepared.tokenizer();
    let mut writer = ShardWriter::create(out_path, tokenizer.vocab_hash(), tokenizer.vocab_size())?;
    let mut open: Option<(usize, ShardReader)> = None;
    for g in plan.sequence_indices() {
        let k = prepared
            .shard_of(g)
            .ok_or_else(|| PrepareError::InvalidOption {
                field: "plan",
                reason: format!("global index {g} is outside the prepared data"),
            })?;
        if open.as_ref().map(|(i, _)| *i) != Some(k) {
            open = Some((k, prepared.open_shard(k)?));
        }
        if let Some((_, reader)) = &open {
            let pos = (g - prepared.manifest().shards[k].first_global_index) as usize;
            let seq = reader.get(pos)?;
            let source = reader.source_index(pos)?;
            writer.push(&seq, source)?;
        }
    }
    finish(writer, out_path, 0)
}

/// Writes to `out_path` rank `rank`'s share of the heldout shard (for evaluation): the
/// contiguous range `[H*rank/W, H*(rank+1)/W)` of its `H` sequences, keeping their heldout
/// indices. A rank may get none when `H < W`.
///
/// Errors: `InvalidOption` for `rank >= world_size`, shard read/write errors.
pub fn build_worker_heldout_shard(
    prepared: &PreparedData,
    world_size: u32,
    rank: u32,
    out_path: &Path,
) -> Result<ShardEntry, PrepareError> {
    if rank >= world_size {
        return Err(PrepareError::InvalidOption {
            field: "rank",
            reason: format!("rank {rank} is out of range for world size {world_size}"),
        });
    }
    let reader = prepared.open_heldout()?;
    let h = reader.len() as u64;
    let start = h * u64::from(rank) / u64::from(world_size);
    let end = h * u64::from(rank + 1) / u64::from(world_size);
    let tokenizer = prepared.tokenizer();
    let mut writer = ShardWriter::create(out_path, tokenizer.vocab_hash(), tokenizer.vocab_size())?;
    for pos in start as usize..end as usize {
        writer.push(&reader.get(pos)?, reader.source_index(pos)?)?;
    }
    finish(writer, out_path, start)
}

fn finish(writer: ShardWriter, out_path: &Path, first: u64) -> Result<ShardEntry, PrepareError> {
    let sequences = writer.len();
    let tokens = writer.num_tokens();
    let checksum = writer.finish()?;
    Ok(ShardEntry {
        file: out_path.display().to_string(),
        sequences,
        tokens,
        first_global_index: first,
        checksum,
    })
}
