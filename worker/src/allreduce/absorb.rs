//! The receiving side of the ring's arithmetic: what a frame from the left neighbour does to the
//! buffer (reduce-scatter: add; all-gather: copy) and what it passes on to the right, and when
//! it must wait because a send still reads the range it writes.
//!
//! Shapes: the buffer is `[len]` f32; a frame covers the elements `range` and carries
//! `range.len() * 4` little-endian bytes of f32, or `range.len() * 2` of bf16 (see
//! `bf16_wire`).

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use keel_proto::ring_rpc::{Collective, WireDtype};

use super::bf16_wire;
use super::mailbox::InboundFrame;
use super::shared_buf::SharedBuf;

/// What is still to be sent for one frame.
pub(super) enum Payload {
    /// The buffer's elements `range`, sent from the buffer itself (the rank's own chunk, a
    /// reduce-scatter partial sum, or the finished chunk): the range must not be written until
    /// the send finishes.
    Buffer(Range<usize>),
    /// Already encoded (an all-gather frame passed on as received, or any bf16 frame: encoding
    /// is a copy, so the buffer is free again at once).
    Ready(Bytes),
}

/// A frame waiting to be sent to the right neighbour.
pub(super) struct Outgoing {
    /// Ring step the right neighbour receives it at.
    pub(super) ring_step: u32,
    /// First element, index into the buffer.
    pub(super) offset: usize,
    /// The elements.
    pub(super) payload: Payload,
}

/// Whether absorbing a frame received for the buffer's elements `range` (every ring step writes
/// them) would write where a queued or unfinished send still reads.
pub(super) fn writes_readers(range: &Range<usize>, readers: &[Range<usize>]) -> bool {
    readers
        .iter()
        .any(|r| r.start < range.end && range.start < r.end)
}

/// [`absorb`]s `frame` (received for the buffer's elements `range`, encoded as `dtype`) and
/// queues what it passes on, noting a send from the buffer in `readers`; or, while a queued or
/// unfinished send still reads `range`, puts it in `deferred` to be tried again after a send
/// finishes.
#[allow(clippy::too_many_arguments)]
pub(super) fn absorb_or_defer(
    n: usize,
    dtype: WireDtype,
    collective: Collective,
    buf: &Arc<SharedBuf>,
    frame: InboundFrame,
    range: Range<usize>,
    outbox: &mut VecDeque<Outgoing>,
    readers: &mut Vec<Range<usize>>,
    deferred: &mut VecDeque<(InboundFrame, Range<usize>)>,
) {
    if writes_readers(&range, readers) {
        deferred.push_back((frame, range));
        return;
    }
    // SAFETY: no queued or unfinished send reads `range` (checked above), and the ring task
    // (the caller) is the buffer's only writer.
    if let Some(out) = unsafe { absorb(n, dtype, collective, buf, frame, range) } {
        if let Payload::Buffer(r) = &out.payload {
            readers.push(r.clone());
        }
        outbox.push_back(out);
    }
}

/// Applies one incoming frame to the buffer's elements `range` and returns what to pass on to
/// the right neighbour.
///
/// Reduce-scatter (ring steps `t <= n - 2`): add the incoming partial sum into the local slice
/// and send that slice on, from the buffer. Before the last step the local slice is not needed
/// again until the all-gather overwrites it, so it can hold the partial sum; at step `n - 2` the
/// sum is final and goes out as all-gather step 0. All-gather: copy, and pass the received
/// bytes on unchanged unless this was the last step.
///
/// In bf16 (`dtype`) the partial sum goes out as an encoded copy, and the finished sum (step
/// `n - 2`) is first rounded to bf16 in place, so this rank keeps what the others will decode.
///
/// A reduce-scatter (`collective`) ends at step `n - 2`: the finished sum stays here. An
/// all-gather's steps are the all-reduce's last `n - 1`, absorbed alike.
///
/// # Safety
/// Nothing else reads or writes `range` of `buf` during the call, and no queued or unfinished
/// send reads `range` (every step writes it).
unsafe fn absorb(
    n: usize,
    dtype: WireDtype,
    collective: Collective,
    buf: &SharedBuf,
    frame: InboundFrame,
    range: Range<usize>,
) -> Option<Outgoing> {
    let t = frame.ring_step as usize;
    let next = frame.ring_step + 1;
    // SAFETY: by the caller's promise `range` is ours alone.
    let local = unsafe { buf.write(range.clone()) };
    if t + 2 <= n {
        let payload = match dtype {
            WireDtype::F32 => {
                add_le(local, &frame.data);
                Payload::Buffer(range.clone())
            }
            WireDtype::Bf16 => {
                bf16_wire::add(local, &frame.data);
                if t + 2 == n {
                    bf16_wire::round_in_place(local);
                }
                Payload::Ready(bf16_wire::encode(local))
            }
        };
        let finished = t + 2 == n && collective == Collective::ReduceScatter;
        (!finished).then_some(Outgoing {
            ring_step: next,
            offset: range.start,
            payload,
        })
    } else {
        match dtype {
            WireDtype::F32 => copy_le(local, &frame.data),
            WireDtype::Bf16 => bf16_wire::copy(local, &frame.data),
        }
        (t + 1 < 2 * (n - 1)).then(|| Outgoing {
            ring_step: next,
            offset: range.start,
            payload: Payload::Ready(frame.data),
        })
    }
}

/// Elements decoded per block by [`for_each_block`] (a 2 KiB stack buffer).
#[cfg(not(target_endian = "little"))]
const BLOCK: usize = 512;

/// Calls `f(start, block)` for consecutive blocks of `incoming` (little-endian f32 bytes)
/// decoded into a stack buffer: the big-endian path of [`copy_le`].
#[cfg(not(target_endian = "little"))]
fn for_each_block(incoming: &[u8], mut f: impl FnMut(usize, &[f32])) {
    let mut buf = [0.0f32; BLOCK];
    for (i, bytes) in incoming.chunks(BLOCK * 4).enumerate() {
        let elems = bytes.len() / 4;
        let block = &mut buf[..elems];
        for (x, b) in block.iter_mut().zip(bytes.chunks_exact(4)) {
            *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        f(i * BLOCK, block);
    }
}

/// `local[i] += incoming[i]` (`incoming`: `local.len() * 4` little-endian bytes).
///
/// Reads each element straight from the frame's bytes (an unaligned load on little-endian
/// machines; the compiler makes it a vector loop). Staging each block in an aligned buffer first,
/// as this did before, added a `memcpy` of every reduce-scatter byte.
fn add_le(local: &mut [f32], incoming: &[u8]) {
    for (a, b) in local.iter_mut().zip(incoming.chunks_exact(4)) {
        *a += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// `local[i] = incoming[i]` (a memcpy on little-endian machines).
fn copy_le(local: &mut [f32], incoming: &[u8]) {
    #[cfg(target_endian = "little")]
    bytemuck::cast_slice_mut::<f32, u8>(local).copy_from_slice(incoming);
    #[cfg(not(target_endian = "little"))]
    for_each_block(incoming, |start, block| {
        local[start..start + block.len()].copy_from_slice(block);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_wait_for_overlapping_sends_only() {
        let readers = [0..100, 300..400];
        assert!(writes_readers(&(50..60), &readers));
        assert!(writes_readers(&(99..150), &readers));
        assert!(writes_readers(&(250..301), &readers));
        // Touching ends do not overlap.
        assert!(!writes_readers(&(100..300), &readers));
        assert!(!writes_readers(&(400..500), &readers));
        assert!(!writes_readers(&(0..10), &[]));
    }

    #[test]
    fn add_and_copy_decode_little_endian_bytes() {
        let incoming: Vec<u8> = (0..1500)
            .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
            .collect();
        let mut local: Vec<f32> = (0..1500).map(|i| i as f32).collect();
        add_le(&mut local, &incoming);
        assert!(local.iter().enumerate().all(|(i, &x)| x == i as f32 * 1.5));
        copy_le(&mut local, &incoming);
        assert!(local.iter().enumerate().all(|(i, &x)| x == i as f32 * 0.5));
    }

    #[test]
    fn add_reads_frames_at_any_byte_alignment() {
        // A frame's bytes sit anywhere inside the HTTP/2 DATA frame they came in.
        for skew in 0..4 {
            let mut wire = vec![0xAAu8; skew];
            wire.extend((0..1001).flat_map(|i| (i as f32 - 500.0).to_le_bytes()));
            let mut local = vec![0.25f32; 1001];
            add_le(&mut local, &wire[skew..]);
            assert!(
                local
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| x == i as f32 - 500.0 + 0.25),
                "skew {skew}"
            );
        }
    }
}
