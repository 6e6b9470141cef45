//! The chunk plan: how a buffer of `len` f32 elements is cut into `world_size` chunks (one per
//! rank, the unit of the ring's reduce-scatter) and each chunk into frames (the unit on the wire).
//!
//! Both are pure functions of their arguments, so every rank derives the same plan without
//! talking, and a frame's `(ring_step, offset)` names exactly one planned frame.

use std::ops::Range;

/// Cuts `len` elements into `world_size` contiguous chunks that cover `0..len` exactly, in order.
///
/// Chunk `i` has `len / world_size` elements, plus one for the first `len % world_size` chunks,
/// so sizes differ by at most one element. When `len < world_size` the last chunks are empty
/// (`start == end`, never `start > end`). `world_size == 0` yields no chunks.
///
/// Returns `world_size` ranges of element indices (units: f32 elements, not bytes).
pub fn chunk_plan(len: usize, world_size: usize) -> Vec<Range<usize>> {
    if world_size == 0 {
        return Vec::new();
    }
    let base = len / world_size;
    let extra = len % world_size;
    (0..world_size)
        .map(|i| {
            let start = i * base + i.min(extra);
            let size = base + usize::from(i < extra);
            start..start + size
        })
        .collect()
}

/// The chunk of a buffer of `len` elements that rank `rank` of `world_size` (>= 1) finishes
/// in a reduce-scatter and starts from in an all-gather: chunk `(rank + 1) % world_size` of
/// [`chunk_plan`] (ZeRO stage 1: the elements whose optimizer state the rank owns).
pub fn owned_chunk(len: usize, world_size: usize, rank: usize) -> Range<usize> {
    let n = world_size.max(1);
    chunk_plan(len, n)[(rank + 1) % n].clone()
}

/// Cuts one chunk into frames of at most `frame_elems` elements (the last one may be shorter).
///
/// Returns the frames' element ranges in order; an empty chunk has no frames. `frame_elems == 0`
/// is treated as 1 so the result is always finite.
pub fn frame_plan(chunk: Range<usize>, frame_elems: usize) -> impl Iterator<Item = Range<usize>> {
    let step = frame_elems.max(1);
    let end = chunk.end;
    (chunk.start..end)
        .step_by(step)
        .map(move |start| start..(start + step).min(end))
}

/// Number of frames `frame_plan(chunk, frame_elems)` yields.
pub fn frame_count(chunk: &Range<usize>, frame_elems: usize) -> usize {
    chunk.len().div_ceil(frame_elems.max(1))
}

/// The chunk rank `rank` receives at ring step `ring_step` of an all-reduce over `world_size`
/// ranks (`world_size >= 2`, `ring_step < 2 * (world_size - 1)`).
///
/// Reduce-scatter step `t` (`t < world_size - 1`): rank r receives chunk `(r - t - 1) mod n` from
/// its left neighbour and adds it to its own; after `n - 1` steps it holds the full sum of chunk
/// `(r + 1) mod n`. All-gather step `t` (ring step `n - 1 + t`): rank r receives the finished
/// chunk `(r - t) mod n` and copies it. (Patarasuk and Yuan, "Bandwidth optimal all-reduce
/// algorithms for clusters of workstations", JPDC 2009, section 3.)
pub fn recv_chunk(rank: usize, world_size: usize, ring_step: usize) -> usize {
    let n = world_size;
    if ring_step < n - 1 {
        (rank + 2 * n - ring_step - 1) % n
    } else {
        (rank + 2 * n - (ring_step - (n - 1))) % n
    }
}

/// The chunk rank `rank` sends at ring step `ring_step` (what its right neighbour receives).
pub fn send_chunk(rank: usize, world_size: usize, ring_step: usize) -> usize {
    recv_chunk((rank + 1) % world_size, world_size, ring_step)
}
