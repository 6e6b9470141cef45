//! The frames one rank expects from its left neighbour in one collective: for a buffer of `len`
//! f32 over `world_size` ranks cut into frames of `frame_elems`, exactly one frame per
//! `(ring_step, offset)` of [`recv_chunk`]'s chunk at each ring step the collective runs
//! (an all-reduce all `2 (world_size - 1)`, a reduce-scatter the first `world_size - 1`, an
//! all-gather the last `world_size - 1`), each as long as [`frame_plan`] cuts it. The mailbox
//! checks every arriving frame against it (so a frame that fits no planned frame holds no
//! memory) and the ring numbers the frames it has seen with it.

use std::ops::Range;

use keel_proto::ring_rpc::{Collective, WireDtype};

use super::plan::{chunk_plan, frame_count, recv_chunk};

/// Where a rank stands in its ring, as far as the receive plan is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RingShape {
    /// Ranks in the ring (>= 1).
    pub world_size: usize,
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// Elements per frame (`frame_bytes / 4`, >= 1, whatever the elements' encoding); the last
    /// frame of a chunk may be shorter.
    pub frame_elems: usize,
}

/// The ring steps `collective` runs over `world_size` ranks (`>= 1`), in the all-reduce's
/// numbering: reduce-scatter `0..n-1`, all-gather `n-1..2(n-1)`, all-reduce both.
pub(crate) fn ring_steps(collective: Collective, world_size: usize) -> Range<usize> {
    let n = world_size.max(1);
    match collective {
        Collective::AllReduce => 0..2 * (n - 1),
        Collective::ReduceScatter => 0..n - 1,
        Collective::AllGather => n - 1..2 * (n - 1),
    }
}

/// The receive plan of one collective (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct FrameSchedule {
    /// The ring.
    shape: RingShape,
    /// Which collective, and so which ring steps.
    collective: Collective,
    /// The ring steps it runs.
    steps: Range<usize>,
    /// The buffer cut into `world_size` chunks (f32 element ranges).
    chunks: Vec<Range<usize>>,
    /// Index of the first frame of each ring step of `steps` in `0..expected`.
    first_frame: Vec<usize>,
    /// Frames expected in all.
    expected: usize,
    /// How the frames encode the elements.
    dtype: WireDtype,
}

/// One planned frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PlannedFrame {
    /// Its number in `0..expected`, ring step by ring step.
    pub index: usize,
    /// Its elements in the buffer.
    pub range: Range<usize>,
}

impl FrameSchedule {
    /// The plan of `collective` over `len` elements sent as `dtype`. World size 1 expects no
    /// frame.
    pub(crate) fn new(
        shape: RingShape,
        len: usize,
        dtype: WireDtype,
        collective: Collective,
    ) -> Self {
        let n = shape.world_size.max(1);
        let chunks = chunk_plan(len, n);
        let steps = ring_steps(collective, n);
        let mut first_frame = Vec::with_capacity(steps.len());
        let mut expected = 0usize;
        for t in steps.clone() {
            first_frame.push(expected);
            expected += frame_count(&chunks[recv_chunk(shape.rank, n, t)], shape.frame_elems);
        }
        FrameSchedule {
            shape,
            collective,
            steps,
            chunks,
            first_frame,
            expected,
            dtype,
        }
    }

    /// How the frames encode the elements.
    pub(crate) fn dtype(&self) -> WireDtype {
        self.dtype
    }

    /// The collective planned.
    pub(crate) fn collective(&self) -> Collective {
        self.collective
    }

    /// Length of the buffer, f32 elements.
    pub(crate) fn len(&self) -> usize {
        self.chunks.last().map_or(0, |c| c.end)
    }

    /// Frames expected from the left neighbour in all.
    pub(crate) fn expected(&self) -> usize {
        self.expected
    }

    /// The ring steps below this are the ones the left neighbour can send before this rank
    /// started the collective. In an all-reduce, the reduce-scatter's `world_size - 1` (every
    /// later one carries this rank's share); in a reduce-scatter or an all-gather, all of them
    /// (no frame this rank receives passed through it).
    pub(crate) fn early_steps_end(&self) -> usize {
        match self.collective {
            Collective::AllReduce => self.shape.world_size.saturating_sub(1),
            Collective::ReduceScatter | Collective::AllGather => self.steps.end,
        }
    }

    /// The planned frame at `ring_step` starting at element `offset` with `elems` elements.
    ///
    /// Errors: why it fits no planned frame (ring step out of range, offset not where a frame
    /// of that step starts, or a length other than the planned one), for the refusal.
    pub(crate) fn locate(
        &self,
        ring_step: u32,
        offset: u64,
        elems: usize,
    ) -> Result<PlannedFrame, String> {
        let t = ring_step as usize;
        if !self.steps.contains(&t) {
            return Err(format!(
                "ring step {t} out of range: a {} over {} ranks runs ring steps {:?}",
                collective_name(self.collective),
                self.shape.world_size,
                self.steps
            ));
        }
        let chunk = &self.chunks[recv_chunk(self.shape.rank, self.shape.world_size, t)];
        let frame_elems = self.shape.frame_elems.max(1);
        let offset = usize::try_from(offset).unwrap_or(usize::MAX);
        let aligned = offset >= chunk.start
            && offset < chunk.end
            && (offset - chunk.start).is_multiple_of(frame_elems);
        let planned_end = offset.saturating_add(frame_elems).min(chunk.end);
        if !aligned || offset.saturating_add(elems) != planned_end {
            return Err(format!(
                "elements {offset}..{} at ring step {t} do not match a planned frame of chunk {chunk:?} ({frame_elems} f32 frames)",
                offset.saturating_add(elems)
            ));
        }
        Ok(PlannedFrame {
            index: self.first_frame[t - self.steps.start] + (offset - chunk.start) / frame_elems,
            range: offset..planned_end,
        })
    }
}

/// The collective's name in messages.
pub(crate) fn collective_name(collective: Collective) -> &'static str {
    match collective {
        Collective::AllReduce => "all-reduce",
        Collective::ReduceScatter => "reduce-scatter",
        Collective::AllGather => "all-gather",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_planned_frame_is_found_once_and_nothing_else() {
        for collective in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
        ] {
            for n in 1..=4 {
                for rank in 0..n {
                    for len in [0usize, 1, 5, 37, 1000] {
                        check_schedule(collective, n, rank, len);
                    }
                }
            }
        }
    }

    /// Every frame of the collective's ring steps is found once; frames off by an element,
    /// and frames of the ring steps it does not run, are refused.
    fn check_schedule(collective: Collective, n: usize, rank: usize, len: usize) {
        let shape = RingShape {
            world_size: n,
            rank,
            frame_elems: 7,
        };
        let s = FrameSchedule::new(shape, len, WireDtype::F32, collective);
        assert_eq!(s.len(), len);
        let mut seen = vec![false; s.expected()];
        let runs = ring_steps(collective, n);
        for t in 0..2 * (n - 1) {
            let chunk = chunk_plan(len, n)[recv_chunk(rank, n, t)].clone();
            for f in super::super::plan::frame_plan(chunk, 7) {
                let found = s.locate(t as u32, f.start as u64, f.len());
                if !runs.contains(&t) {
                    assert!(found.is_err(), "{collective:?} ring step {t} of {n}");
                    continue;
                }
                let p = found.unwrap();
                assert_eq!(p.range, f);
                assert!(!std::mem::replace(&mut seen[p.index], true));
                // Off by one element either way, or one element short: refused.
                assert!(s.locate(t as u32, f.start as u64 + 1, f.len()).is_err());
                assert!(s.locate(t as u32, f.start as u64, f.len() + 1).is_err());
                if f.len() > 1 {
                    assert!(s.locate(t as u32, f.start as u64, f.len() - 1).is_err());
                }
            }
        }
        assert!(
            seen.iter().all(|&x| x),
            "{collective:?} n {n} rank {rank} len {len}"
        );
        assert!(s.locate(2 * (n as u32 - 1), 0, 1).is_err());
        assert!(s.locate(0, u64::MAX, 1).is_err());
    }

    #[test]
    fn half_collectives_run_half_the_ring_steps() {
        assert_eq!(ring_steps(Collective::AllReduce, 4), 0..6);
        assert_eq!(ring_steps(Collective::ReduceScatter, 4), 0..3);
        assert_eq!(ring_steps(Collective::AllGather, 4), 3..6);
        assert_eq!(ring_steps(Collective::AllGather, 1), 0..0);
        let shape = RingShape {
            world_size: 3,
            rank: 1,
            frame_elems: 4,
        };
        let early = |c| FrameSchedule::new(shape, 30, WireDtype::F32, c).early_steps_end();
        assert_eq!(early(Collective::AllReduce), 2);
        assert_eq!(early(Collective::ReduceScatter), 2);
        assert_eq!(early(Collective::AllGather), 4);
    }
}
