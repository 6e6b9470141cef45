//! One rank's training state, `(step, weights, optimizer state)`, which outlives a generation:
//! when the ring breaks, the worker keeps it in memory, and the next generation goes on from
//! it. Every replica of a job holds the same state after the same step, so any rank that holds
//! the newest step can give it to the ranks that do not (a new worker, or one that was a step
//! behind when the ring broke) by [`broadcast`]. With DiLoCo (`crate::optim::Diloco`) that
//! holds only at the end of a round; inside one, the broadcast gives every rank the root's
//! local weights and inner moments, and the round goes on from there.

use crate::buckets::{BUCKET_ELEMS, SpecialBucket};
use crate::optim::Optimizer;
use crate::ringlink::{RingLink, RingLinkError, RingReply};

/// Bits per f32 piece when an integer travels through the all-reduce (exact below 2^24).
const PIECE_BITS: u32 = 22;

/// Why a broadcast failed.
#[derive(Debug, thiserror::Error)]
pub enum BroadcastError {
    /// The ring failed or the job was stopped.
    #[error(transparent)]
    Ring(#[from] RingLinkError),
    /// The received optimizer state does not fit this rank's optimizer.
    #[error("received optimizer state does not fit: {0}")]
    State(String),
    /// A sharded optimizer's state cannot be gathered from the ranks' memory: a share of it
    /// is missing (its rank is gone). The job goes on from its newest checkpoint.
    #[error("the sharded optimizer state is incomplete: {0}")]
    Incomplete(String),
}

/// A rank's complete training state after `step` optimizer steps.
pub struct Replica {
    /// Steps completed (the next step to run is `step`, 0-based).
    pub step: u64,
    /// Weights, `[P]` flat in the HF state-dict layout.
    pub params: Vec<f32>,
    /// The optimizer with its moments (`[P]` each) and step count.
    pub optimizer: Box<dyn Optimizer>,
    /// Steps whose update was skipped (non-finite) so far.
    pub skipped_steps: u64,
    /// Whose share of the moments a sharded optimizer holds (`train.shard_optimizer`); `None`
    /// for an unsharded one, which holds them all.
    pub shard: Option<ShardOf>,
}

/// Rank `rank` of a generation of `world_size` ranks: which share of a sharded optimizer's
/// moments a replica holds (`train::sharding::Sharding::for_world` gives its chunks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardOf {
    /// The generation's world size.
    pub world_size: u32,
    /// The rank that held it.
    pub rank: u32,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("step", &self.step)
            .field("params", &self.params.len())
            .field("skipped_steps", &self.skipped_steps)
            .finish_non_exhaustive()
    }
}

/// A replica kept by the worker process between generations of one job.
#[derive(Debug)]
pub struct HeldReplica {
    /// The job.
    pub job_id: String,
    /// The generation that produced it.
    pub generation: u64,
    /// The state.
    pub replica: Replica,
}

/// `value` as three exact f32 pieces of [`PIECE_BITS`] bits each (values below 2^66).
pub(crate) fn pieces(value: u64) -> [f32; 3] {
    let mask = (1u64 << PIECE_BITS) - 1;
    [
        (value & mask) as f32,
        ((value >> PIECE_BITS) & mask) as f32,
        ((value >> (2 * PIECE_BITS)) & mask) as f32,
    ]
}

/// Inverse of [`pieces`].
pub(crate) fn from_pieces(p: &[f32]) -> u64 {
    p.iter()
        .enumerate()
        .map(|(i, &x)| (x as u64) << (PIECE_BITS * i as u32))
        .sum()
}

/// Makes every rank's `replica` equal to the root's, bit for bit, with the ring all-reduce:
/// the root contributes its values and every other rank `-0.0`, and `x + (-0.0) = x` exactly
/// for every f32 `x` (IEEE 754, round to nearest), whatever the order of the sum.
/// Non-root ranks pass a replica of the right shape (fresh optimizer, any weights). Buckets
/// [`SpecialBucket::Broadcast`]`.id()..` of `step` carry it, in chunks of [`BUCKET_ELEMS`].
///
/// Errors: [`BroadcastError::Ring`] from the ring (`Aborted` if the job is stopped meanwhile);
/// [`BroadcastError::State`] if the optimizer rejects the received buffers.
pub fn broadcast(
    ring: &RingLink,
    step: u64,
    is_root: bool,
    replica: &mut Replica,
) -> Result<(), BroadcastError> {
    broadcast_parts(ring, step, is_root, replica, true).map(|_| ())
}

/// [`broadcast`] of the step, skipped-step count and weights only (a sharded optimizer's
/// moments are gathered otherwise: `train::regather`); returns the root's optimizer step count.
///
/// Errors: [`BroadcastError::Ring`].
pub fn broadcast_weights(
    ring: &RingLink,
    step: u64,
    is_root: bool,
    replica: &mut Replica,
) -> Result<u64, BroadcastError> {
    broadcast_parts(ring, step, is_root, replica, false)
}

/// [`broadcast`], with the optimizer state or without; returns the root's `steps_taken`.
fn broadcast_parts(
    ring: &RingLink,
    step: u64,
    is_root: bool,
    replica: &mut Replica,
    with_state: bool,
) -> Result<u64, BroadcastError> {
    let contribute = |data: &[f32]| -> Vec<f32> {
        if is_root {
            data.to_vec()
        } else {
            vec![-0.0; data.len()]
        }
    };
    let mut bucket = SpecialBucket::Broadcast.id();
    let mut next_bucket = || {
        let b = bucket;
        bucket += 1;
        b
    };
    let mut scalars = Vec::with_capacity(9);
    scalars.extend(pieces(replica.step));
    scalars.extend(pieces(replica.optimizer.steps_taken()));
    scalars.extend(pieces(replica.skipped_steps));
    let scalars = ring.submit(step, next_bucket(), contribute(&scalars));

    let submit_all = |data: &[f32], next_bucket: &mut dyn FnMut() -> u32| -> Vec<RingReply> {
        data.chunks(BUCKET_ELEMS)
            .map(|chunk| ring.submit(step, next_bucket(), contribute(chunk)))
            .collect()
    };
    let params = submit_all(&replica.params, &mut next_bucket);
    let names: Vec<&'static str> = if with_state {
        replica.optimizer.state().iter().map(|(n, _)| *n).collect()
    } else {
        Vec::new()
    };
    let mut state_replies = Vec::with_capacity(names.len());
    if with_state {
        for (_, data) in replica.optimizer.state() {
            state_replies.push(submit_all(data, &mut next_bucket));
        }
    }

    let gather = |replies: Vec<RingReply>, len: usize| -> Result<Vec<f32>, RingLinkError> {
        let mut out = Vec::with_capacity(len);
        for reply in replies {
            out.extend(reply.wait()?);
        }
        Ok(out)
    };
    let scalars = scalars.wait()?;
    let params = gather(params, replica.params.len())?;
    let mut states = Vec::with_capacity(names.len());
    for (replies, (_, data)) in state_replies.into_iter().zip(replica.optimizer.state()) {
        states.push(gather(replies, data.len())?);
    }
    let steps_taken = from_pieces(&scalars[3..6]);
    if !is_root {
        replica.step = from_pieces(&scalars[0..3]);
        replica.skipped_steps = from_pieces(&scalars[6..9]);
        replica.params = params;
        if with_state {
            let views: Vec<(&str, &[f32])> = names
                .iter()
                .zip(&states)
                .map(|(n, d)| (*n, d.as_slice()))
                .collect();
            replica
                .optimizer
                .load_state(steps_taken, &views)
                .map_err(|e| BroadcastError::State(e.to_string()))?;
        }
    }
    Ok(steps_taken)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_survive_the_f32_pieces() {
        for v in [
            0u64,
            1,
            41,
            (1 << 22) - 1,
            1 << 22,
            123_456_789_012,
            u64::MAX >> 2,
        ] {
            assert_eq!(from_pieces(&pieces(v)), v);
        }
    }

    #[test]
    fn adding_negative_zero_changes_no_bit() {
        for x in [
            0.0f32,
            -0.0,
            1.5,
            -3.25e-30,
            f32::MIN_POSITIVE / 2.0,
            f32::MAX,
            f32::INFINITY,
        ] {
            assert_eq!((x + -0.0).to_bits(), x.to_bits());
            assert_eq!((-0.0f32 + x).to_bits(), x.to_bits());
        }
    }
}
