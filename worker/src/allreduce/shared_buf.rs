//! The buffer of one all-reduce, shared between the ring, which adds into and copies into parts
//! of it, and the frames sent from it, which HTTP/2 reads on other threads. Sending a part of
//! the buffer then costs no copy: the frame's payload is a [`Bytes`] that points into the
//! buffer and keeps it alive.
//!
//! Soundness rests on one rule, kept by `Ring::all_reduce_sum`: a part is never written while
//! a frame sent from it may still be read: until its send is acked (the connection that carried
//! the ack has written the frame), and, when an earlier attempt failed, until every copy of the
//! payload is gone (a failed call may still hold one in its queues). Frames hold an [`Arc`] of the buffer, so memory outlives every frame even when the
//! all-reduce gives up early.

use std::mem::ManuallyDrop;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::oneshot;

/// A `Vec<f32>` (`[len]`) whose disjoint parts one writer and many readers use at once.
pub(crate) struct SharedBuf {
    /// The vector's allocation.
    ptr: NonNull<f32>,
    /// Elements.
    len: usize,
    /// Allocated elements (to give the allocation back as the same `Vec`).
    cap: usize,
}

// SAFETY: the buffer owns its allocation like a `Vec<f32>`; concurrent access is limited to
// reads by frames and writes by the one ring task to other parts (see the module doc).
unsafe impl Send for SharedBuf {}
// SAFETY: as above; `&SharedBuf` only gives reads, and writes through `write` are `unsafe`.
unsafe impl Sync for SharedBuf {}

impl SharedBuf {
    /// Takes over `values`.
    pub(crate) fn new(values: Vec<f32>) -> SharedBuf {
        let mut v = ManuallyDrop::new(values);
        SharedBuf {
            // A `Vec`'s pointer is never null (dangling but aligned when empty).
            ptr: NonNull::new(v.as_mut_ptr()).unwrap_or(NonNull::dangling()),
            len: v.len(),
            cap: v.capacity(),
        }
    }

    /// Reads `range`.
    ///
    /// # Safety
    /// Nothing writes `range` while the slice lives (the ring task is the only writer, and it
    /// does not hold this slice across a `write`).
    /// Panics if `range` is out of bounds.
    pub(crate) unsafe fn read(&self, range: Range<usize>) -> &[f32] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range {range:?} out of bounds"
        );
        // SAFETY: in bounds (checked); no writer of `range` by the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(range.start), range.len()) }
    }

    /// Writes `range`.
    ///
    /// # Safety
    /// No one else reads or writes `range` while the slice lives: no frame sent from it is
    /// still queued, in flight or unacknowledged.
    /// Panics if `range` is out of bounds.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn write(&self, range: Range<usize>) -> &mut [f32] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range {range:?} out of bounds"
        );
        // SAFETY: in bounds (checked); exclusive by the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(range.start), range.len()) }
    }

    /// The vector back, without a copy when no frame holds the buffer any more, else a copy.
    pub(crate) fn into_vec(this: Arc<SharedBuf>) -> Vec<f32> {
        match Arc::try_unwrap(this) {
            Ok(buf) => {
                let buf = ManuallyDrop::new(buf);
                // SAFETY: the parts of the `Vec` taken apart in `new`, given back once
                // (`ManuallyDrop` keeps `Drop` from freeing them).
                unsafe { Vec::from_raw_parts(buf.ptr.as_ptr(), buf.len, buf.cap) }
            }
            // A frame's payload is still referenced (e.g. by the HTTP/2 send queue after its
            // ack): copy; its memory is freed when the last frame goes.
            // SAFETY: only frames hold it, and they only read.
            Err(shared) => unsafe { shared.read(0..shared.len) }.to_vec(),
        }
    }

    /// `range` as little-endian bytes for a frame's payload, and a receiver that completes
    /// (with `Err`) once every clone of the payload has been dropped. On little-endian machines
    /// the payload points into the buffer (no copy) and keeps it alive.
    ///
    /// # Safety
    /// Nothing writes `range` until every clone of the returned `Bytes` has been read for the
    /// last time (the caller tracks the frame until its send finishes).
    pub(crate) unsafe fn bytes(
        this: &Arc<SharedBuf>,
        range: Range<usize>,
    ) -> (Bytes, oneshot::Receiver<()>) {
        assert!(
            range.start <= range.end && range.end <= this.len,
            "range {range:?} out of bounds"
        );
        let (released_tx, released) = oneshot::channel();
        #[cfg(target_endian = "little")]
        {
            let part = Part {
                buf: Arc::clone(this),
                range,
                _released: released_tx,
            };
            (Bytes::from_owner(part), released)
        }
        #[cfg(not(target_endian = "little"))]
        {
            // SAFETY: no writer of `range` by the caller's promise.
            let values = unsafe { this.read(range) };
            let mut out = Vec::with_capacity(values.len() * 4);
            for v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
            // A copy: nothing points into the buffer.
            drop(released_tx);
            (Bytes::from(out), released)
        }
    }
}

impl Drop for SharedBuf {
    fn drop(&mut self) {
        // SAFETY: the parts of the `Vec` taken apart in `new`; dropped once.
        unsafe { drop(Vec::from_raw_parts(self.ptr.as_ptr(), self.len, self.cap)) }
    }
}

/// A part of a [`SharedBuf`] as a frame's payload.
#[cfg(target_endian = "little")]
struct Part {
    buf: Arc<SharedBuf>,
    /// Elements, within bounds (checked in `SharedBuf::bytes`).
    range: Range<usize>,
    /// Dropped with the last clone of the payload, which tells the receiver returned with it.
    _released: oneshot::Sender<()>,
}

#[cfg(target_endian = "little")]
impl AsRef<[u8]> for Part {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: in bounds (checked in `SharedBuf::bytes`); no writer while a frame holds
        // the part (module doc). On a little-endian machine the elements' bytes are their
        // little-endian encoding.
        bytemuck::cast_slice(unsafe { self.buf.read(self.range.clone()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_the_elements_bytes_and_the_vector_comes_back() {
        let buf = Arc::new(SharedBuf::new(vec![1.0, -2.5, 3.0, 4.0]));
        // SAFETY: no writes in this test while the payload lives.
        let (part, mut released) = unsafe { SharedBuf::bytes(&buf, 1..3) };
        let clone = part.clone();
        let mut want = Vec::new();
        want.extend_from_slice(&(-2.5f32).to_le_bytes());
        want.extend_from_slice(&3.0f32.to_le_bytes());
        assert_eq!(&part[..], &want[..]);
        // A payload alive: the vector comes back as a copy, and the payload stays valid.
        let copy = SharedBuf::into_vec(Arc::clone(&buf));
        assert_eq!(copy, vec![1.0, -2.5, 3.0, 4.0]);
        assert_eq!(&part[..], &want[..]);
        drop(part);
        // A clone is still alive: not released yet.
        assert_eq!(
            released.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        );
        drop(clone);
        assert_eq!(
            released.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        );
        // SAFETY: no payload and no other reader any more.
        let first = unsafe { buf.write(0..1) };
        first[0] = 7.0;
        assert_eq!(SharedBuf::into_vec(buf), vec![7.0, -2.5, 3.0, 4.0]);
    }

    #[test]
    fn an_empty_vector_round_trips() {
        let buf = Arc::new(SharedBuf::new(Vec::new()));
        assert!(SharedBuf::into_vec(buf).is_empty());
    }
}
