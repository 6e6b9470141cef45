//! Gradient buckets: the flat gradient buffer cut into fixed ranges that go to the ring
//! all-reduce as soon as backward has finished them, while backward continues on earlier
//! layers (Horovod's tensor fusion / PyTorch DDP's buckets).
//!
//! Backward reports finished ranges of the gradient buffer (last layers first); a bucket is
//! sent when every element of its range has been reported. The order in which buckets
//! complete is a function of the model only, so every rank sends them in the same order.

use crate::ringlink::{RingLink, RingReply};
use std::ops::Range;

/// Elements per bucket: 1 Mi f32 = 4 MiB.
pub const BUCKET_ELEMS: usize = 1 << 20;

/// Bucket id offsets: ids below [`FIRST_SPECIAL_BUCKET`] are gradient buckets.
pub const FIRST_SPECIAL_BUCKET: u32 = 1 << 30;

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
}

/// Cuts `0..len` into consecutive ranges of at most `bucket_elems` (the last one shorter).
/// `len = 0` gives no ranges.
pub fn bucket_ranges(len: usize, bucket_elems: usize) -> Vec<Range<usize>> {
    let size = bucket_elems.max(1);
    (0..len.div_ceil(size))
        .map(|i| i * size..((i + 1) * size).min(len))
        .collect()
}

impl Buckets {
    /// Buckets over a gradient buffer of `len` elements.
    pub fn new(len: usize, bucket_elems: usize) -> Self {
        let ranges = bucket_ranges(len, bucket_elems);
        let n = ranges.len();
        Buckets {
            remaining: ranges.iter().map(|r| r.len()).collect(),
            buffers: ranges.iter().map(|r| vec![0.0; r.len()]).collect(),
            sent: vec![false; n],
            pending: Vec::with_capacity(n),
            ranges,
        }
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
        let first = range.start / self.bucket_elems();
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

    /// Waits for every sent bucket's sum and writes it into `grads`.
    ///
    /// Errors: the first all-reduce error, as the ring reported it.
    pub fn finish(&mut self, grads: &mut [f32]) -> Result<(), crate::ringlink::RingLinkError> {
        for (b, reply) in self.pending.drain(..) {
            let data = reply.wait()?;
            grads[self.ranges[b].clone()].copy_from_slice(&data);
            self.buffers[b] = data;
        }
        Ok(())
    }

    fn bucket_elems(&self) -> usize {
        self.ranges.first().map_or(1, |r| r.len().max(1))
    }

    fn send(&mut self, b: usize, ring: &RingLink, step: u64) {
        self.sent[b] = true;
        let data = std::mem::take(&mut self.buffers[b]);
        self.pending.push((b, ring.submit(step, b as u32, data)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_ranges_cover_the_buffer_exactly() {
        for len in [0usize, 1, 5, 7, 8, 9, 1000, 4097] {
            for size in [1usize, 2, 3, 4, 8, 4096] {
                let ranges = bucket_ranges(len, size);
                let mut next = 0;
                for r in &ranges {
                    assert_eq!(r.start, next, "len {len} size {size}");
                    assert!(r.start < r.end && r.len() <= size, "{r:?}");
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}
