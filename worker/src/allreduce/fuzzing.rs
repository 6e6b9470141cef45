//! What a [`super::Ring`] does to the worker's [`Mailbox`], callable without a ring: for the fuzz
//! targets (`fuzz-targets/`), which feed `Ring/Stream` bytes to a mailbox that joined a small
//! ring. Not part of the worker's API: nothing in the worker calls it.

use std::sync::Arc;

use futures::FutureExt;

use super::error::AllReduceError;
use super::expect::RingShape;
use super::mailbox::{Inbox, Mailbox};
use super::{Collective, WireDtype};

/// Makes `mailbox` serve (`job_id`, `generation`) with this worker at `rank` of a ring of
/// `world_size`, frames of `frame_elems` elements, as [`super::Ring::connect`] does.
///
/// Errors: [`AllReduceError::StaleGeneration`] (a newer generation was joined);
/// [`AllReduceError::InvalidConfig`] for a shape that is no ring (`world_size` 0, `rank` outside it,
/// `frame_elems` 0).
pub fn join(
    mailbox: &Mailbox,
    job_id: &str,
    generation: u64,
    world_size: usize,
    rank: usize,
    frame_elems: usize,
) -> Result<(), AllReduceError> {
    if world_size == 0 || rank >= world_size || frame_elems == 0 {
        return Err(AllReduceError::InvalidConfig {
            reason: format!(
                "rank {rank} of {world_size} with frames of {frame_elems} elements is no ring"
            ),
        });
    }
    let shape = RingShape {
        world_size,
        rank,
        frame_elems,
    };
    mailbox.join(job_id, generation, shape)
}

/// One all-reduce started in a mailbox, as [`super::Ring`] starts it; closed when dropped.
pub struct OpenAllReduce(Inbox);

impl OpenAllReduce {
    /// Starts the all-reduce (`step`, `bucket`) of `total_len` elements in the mailbox's current
    /// (`job_id`, `generation`).
    ///
    /// Errors: as the ring's start of an all-reduce (not joined, stale generation, a duplicate).
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        mailbox: &Arc<Mailbox>,
        job_id: &str,
        generation: u64,
        step: u64,
        bucket: u32,
        total_len: usize,
        dtype: WireDtype,
        collective: Collective,
    ) -> Result<OpenAllReduce, AllReduceError> {
        mailbox
            .open(
                job_id, generation, step, bucket, total_len, dtype, collective,
            )
            .map(OpenAllReduce)
    }

    /// Takes every frame already queued for this all-reduce (without waiting) and returns how
    /// many there were, checking each one's payload is whole elements inside the buffer.
    pub fn drain(&mut self) -> usize {
        let mut taken = 0;
        while let Some(Some(frame)) = self.0.recv().now_or_never() {
            let size = match frame.dtype {
                WireDtype::F32 => 4,
                WireDtype::Bf16 => 2,
            };
            assert!(
                frame.data.len().is_multiple_of(size),
                "the mailbox admitted a frame of part elements"
            );
            let end = frame.offset + (frame.data.len() / size) as u64;
            assert!(
                end <= frame.total_len,
                "the mailbox admitted a frame outside its buffer"
            );
            taken += 1;
        }
        taken
    }
}
