//! Gradient buckets: the flat gradient buffer cut into fixed ranges that go to the ring
//! all-reduce as soon as backward has finished them, while backward continues on earlier
//! layers (Horovod's tensor fusion / PyTorch DDP's buckets).
//!
//! Backward reports finished ranges of the gradient buffer, in the order it finishes them (the
//! heads and last layers first, see `Bert::ready_ranges`); a bucket is
//! sent when every element of its range has been reported. Buckets are cut at the edges of
//! those ranges, so a bucket never waits for a part of the model that finishes later. The
//! order in which buckets complete is a function of the model only, so every rank sends them
//! in the same order.

use crate::allreduce::{Collective, WireDtype, owned_chunk};
use crate::ringlink::{RingLink, RingReply};
use std::ops::Range;

/// Elements per bucket of the state broadcast (1 Mi f32 = 4 MiB), and the gradient buckets'
/// default (`train.bucket_mib = 4`).
pub const BUCKET_ELEMS: usize = 1 << 20;

/// Bucket id offsets: ids below [`FIRST_SPECIAL_BUCKET`] are gradient buckets.
pub const FIRST_SPECIAL_BUCKET: u32 = 1 << 30;

/// The all-reduces of a step that are not gradient buckets, each with its bucket id on the
/// wire: the one place those ids are defined. Every rank submits them in the same order, and
/// a (step, id) pair names one all-reduce, so the ids must be distinct (a unit test checks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpecialBucket {
    /// The step's counts: `[masked tokens, NSP labels, real tokens]`, then, with several
    /// ranks, `[v]` presence flags (how many ranks use each token id).
    Counts,
    /// The step's loss sums: `[mlm loss sum, mlm correct, nsp loss sum, nsp correct]`.
    Loss,
    /// An eval's sums: `[mlm loss sum, masked tokens, correct]`.
    Eval,
    /// The word embeddings' lookup-gradient rows, `[u, c]` (several ranks only).
    LookupRows,
    /// The first of the state broadcast's buckets (`Broadcast.id()..`, upwards, below
    /// `ParamGather`: a broadcast takes a few buckets per 4 MiB of state).
    Broadcast,
    /// The summed gradient's squared norm, `[1]` (`train.shard_optimizer`).
    GradNorm,
    /// LAMB's per-tensor squared norms of weights and updates (`train.shard_optimizer`).
    TrustNorms,
    /// The first of the updated weights' all-gather buckets, one per gradient bucket
    /// (`train.shard_optimizer`).
    ParamGather,
    /// The first of the optimizer state's all-gather buckets before a checkpoint, one per
    /// gradient bucket per state buffer (`train.shard_optimizer`).
    StateGather,
    /// The first of the buckets that gather a sharded optimizer's moments from the ranks'
    /// memory at the start of a generation (`train::regather`).
    Regather,
}

impl SpecialBucket {
    /// Every special bucket, in id order.
    pub const ALL: [SpecialBucket; 10] = [
        SpecialBucket::Counts,
        SpecialBucket::Loss,
        SpecialBucket::Eval,
        SpecialBucket::LookupRows,
        SpecialBucket::GradNorm,
        SpecialBucket::TrustNorms,
        SpecialBucket::Broadcast,
        SpecialBucket::ParamGather,
        SpecialBucket::StateGather,
        SpecialBucket::Regather,
    ];

    /// The bucket id this all-reduce travels under (unchanged wire values: `2^30 + 0..3`, and
    /// `2^30 + 16` for the broadcast's first bucket).
    pub const fn id(self) -> u32 {
        FIRST_SPECIAL_BUCKET
            + match self {
                SpecialBucket::Counts => 0,
                SpecialBucket::Loss => 1,
                SpecialBucket::Eval => 2,
                SpecialBucket::LookupRows => 3,
                SpecialBucket::GradNorm => 4,
                SpecialBucket::TrustNorms => 5,
                SpecialBucket::Broadcast => 16,
                SpecialBucket::ParamGather => 1 << 28,
                SpecialBucket::StateGather => 1 << 29,
                SpecialBucket::Regather => (1 << 29) + (1 << 28),
            }
    }
}

/// The buckets of one gradient buffer, reused step after step.
#[derive(Debug)]
pub struct Buckets {
    /// Range of the flat buffer each bucket covers; together an exact cover of `0..len`.
    ranges: Vec<Range<usize>>,
    /// Elements of each bucket not yet reported final this step.
    remaining: Vec<usize>,
    /// Staging copy of each bucket; empty while the bucket is away at the ring.
    buffers: Vec<Vec<f32>>,
    /// Whether each bucket was sent this step.
    sent: Vec<bool>,
    /// Replies to wait for, in send order.
    pending: Vec<(usize, RingReply)>,
    /// How the buckets travel on the ring (`train.allreduce_dtype`).
    dtype: WireDtype,
    /// All-reduce, or reduce-scatter (`train.shard_optimizer`).
    collective: Collective,
    /// The part of each bucket (relative to its start) whose sum comes back: all of it, or
    /// this rank's chunk after a reduce-scatter.
    kept: Vec<Range<usize>>,
}

/// Cuts each of `groups` (ranges of the gradient buffer that become final together, in any
/// order) into the fewest nearly equal ranges of at most `bucket_elems`, and returns them all
/// in buffer order. Empty groups give no ranges.
pub fn bucket_ranges(groups: &[Range<usize>], bucket_elems: usize) -> Vec<Range<usize>> {
    let size = bucket_elems.max(1);
    let mut sorted = groups.to_vec();
    sorted.sort_by_key(|g| g.start);
    let mut out = Vec::new();
    for g in sorted {
        let parts = g.len().div_ceil(size);
        out.extend(
            (0..parts).map(|p| g.start + p * g.len() / parts..g.start + (p + 1) * g.len() / parts),
        );
    }
    out
}

impl Buckets {
    /// Buckets over a gradient buffer whose ranges `groups` (which must cover it exactly once)
    /// each become final together; see [`bucket_ranges`]. The buckets travel as `dtype`.
    pub fn new(groups: &[Range<usize>], bucket_elems: usize, dtype: WireDtype) -> Self {
        let ranges = bucket_ranges(groups, bucket_elems);
        let n = ranges.len();
        Buckets {
            remaining: ranges.iter().map(|r| r.len()).collect(),
            buffers: ranges.iter().map(|r| vec![0.0; r.len()]).collect(),
            sent: vec![false; n],
            pending: Vec::with_capacity(n),
            kept: ranges.iter().map(|r| 0..r.len()).collect(),
            ranges,
            dtype,
            collective: Collective::AllReduce,
        }
    }

    /// The same buckets sent as reduce-scatters (ZeRO stage 1, `train.shard_optimizer`): after
    /// [`Buckets::finish`] only rank `rank`'s chunk of each bucket
    /// (`crate::allreduce::owned_chunk`) holds the sum; the rest of the gradient is left as
    /// this rank's own.
    pub fn reduce_scatter(mut self, world_size: usize, rank: usize) -> Self {
        self.collective = Collective::ReduceScatter;
        self.kept = self
            .ranges
            .iter()
            .map(|r| owned_chunk(r.len(), world_size, rank))
            .collect();
        self
    }

    /// The buckets' ranges of the buffer, in buffer order.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// How the buckets travel on the ring.
    pub fn dtype(&self) -> WireDtype {
        self.dtype
    }

    /// Starts a step: nothing is final, nothing sent.
    pub fn begin(&mut self) {
        for (rem, r) in self.remaining.iter_mut().zip(&self.ranges) {
            *rem = r.len();
        }
        self.sent.iter_mut().for_each(|s| *s = false);
        self.pending.clear();
    }

    /// Backward says `grads[range]` (`data`, `range.len()` elements) is final: copies it into
    /// the buckets it overlaps and sends every bucket that became complete.
    pub fn ready(&mut self, range: Range<usize>, data: &[f32], ring: &RingLink, step: u64) {
        let first = self.ranges.partition_point(|r| r.end <= range.start);
        for b in first..self.ranges.len() {
            let r = self.ranges[b].clone();
            if r.start >= range.end {
                break;
            }
            if self.sent[b] {
                continue;
            }
            let lo = r.start.max(range.start);
            let hi = r.end.min(range.end);
            if lo >= hi {
                continue;
            }
            self.buffers[b][lo - r.start..hi - r.start]
                .copy_from_slice(&data[lo - range.start..hi - range.start]);
            self.remaining[b] = self.remaining[b].saturating_sub(hi - lo);
            if self.remaining[b] == 0 {
                self.send(b, ring, step);
            }
        }
    }

    /// Sends every bucket backward did not report, from the last to the first, copying it
    /// from `grads`.
    pub fn flush(&mut self, grads: &[f32], ring: &RingLink, step: u64) {
        for b in (0..self.ranges.len()).rev() {
            if !self.sent[b] {
                let r = self.ranges[b].clone();
                self.buffers[b].copy_from_slice(&grads[r]);
                self.send(b, ring, step);
            }
        }
    }

    /// Waits for every sent bucket's sum and writes it into `grads` (after a reduce-scatter,
    /// this rank's chunk of each bucket only).
    ///
    /// Errors: the first all-reduce error, as the ring reported it.
    pub fn finish(&mut self, grads: &mut [f32]) -> Result<(), crate::ringlink::RingLinkError> {
        for (b, reply) in self.pending.drain(..) {
            let data = reply.wait()?;
            let (start, kept) = (self.ranges[b].start, self.kept[b].clone());
            grads[start + kept.start..start + kept.end].copy_from_slice(&data[kept]);
            self.buffers[b] = data;
        }
        Ok(())
    }

    fn send(&mut self, b: usize, ring: &RingLink, step: u64) {
        self.sent[b] = true;
        let data = std::mem::take(&mut self.buffers[b]);
        let reply = ring.submit_collective(step, b as u32, data, self.dtype, self.collective);
        self.pending.push((b, reply));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_bucket_ids_are_distinct_and_above_every_gradient_bucket() {
        let ids: Vec<u32> = SpecialBucket::ALL.iter().map(|b| b.id()).collect();
        let mut unique = ids.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ids.len(), "{ids:?}");
        // The wire values of today's workers.
        assert_eq!(
            ids,
            vec![
                1 << 30,
                (1 << 30) + 1,
                (1 << 30) + 2,
                (1 << 30) + 3,
                (1 << 30) + 4,
                (1 << 30) + 5,
                (1 << 30) + 16,
                (1 << 30) + (1 << 28),
                (1 << 30) + (1 << 29),
                (1 << 30) + (1 << 29) + (1 << 28),
            ]
        );
        // Gradient buckets are numbered 0.. and never reach the special ids: a u32-indexed
        // buffer of f32 cut into BUCKET_ELEMS pieces has fewer than 2^30 buckets.
        assert!((u32::MAX as usize).div_ceil(BUCKET_ELEMS) < FIRST_SPECIAL_BUCKET as usize);
        // The ranges upwards from the broadcast's, the weights' and the state's first ids
        // do not meet for any model below 2^28 buckets of state (2^48 elements).
        let broadcast = SpecialBucket::Broadcast.id();
        assert!(ids[..6].iter().all(|&id| id < broadcast));
        assert!(SpecialBucket::ParamGather.id() - broadcast >= (1 << 28) - 16);
        assert!(SpecialBucket::StateGather.id() - SpecialBucket::ParamGather.id() >= 1 << 28);
        assert!(
            SpecialBucket::StateGather
                .id()
                .checked_add(1 << 29)
                .is_some()
        );
    }

    #[test]
    fn bucket_ranges_cover_the_buffer_exactly() {
        for len in [0usize, 1, 5, 7, 8, 9, 1000, 4097] {
            for size in [1usize, 2, 3, 4, 8, 4096] {
                let whole = 0..len;
                let ranges = bucket_ranges(std::slice::from_ref(&whole), size);
                let mut next = 0;
                for r in &ranges {
                    assert_eq!(r.start, next, "len {len} size {size}");
                    assert!(r.start < r.end && r.len() <= size, "{r:?}");
                    next = r.end;
                }
                assert_eq!(next, len);
                assert_eq!(ranges.len(), len.div_ceil(size));
            }
        }
    }

    #[test]
    fn buckets_are_cut_at_group_edges_and_never_span_two_groups() {
        let groups = [40..100, 0..25, 25..40, 100..101];
        let ranges = bucket_ranges(&groups, 16);
        assert_eq!(
            ranges,
            vec![
                0..12,
                12..25,
                25..40,
                40..55,
                55..70,
                70..85,
                85..100,
                100..101
            ]
        );
    }
}
