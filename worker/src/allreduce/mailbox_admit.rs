//! The mailbox's admission check: whether a frame from the left neighbour may be taken, and
//! where it goes. A pure function of what the mailbox's state shows it under its lock
//! ([`AdmissionState`]; `super::Mailbox::deliver` calls it before waiting for room and again
//! after), with the keys and step window it decides by. It names nothing of the mailbox: the
//! mailbox implements [`AdmissionState`] for its state.

use std::collections::HashSet;

use keel_proto::ring_rpc::{Collective, RingFrame, WireDtype};

use crate::allreduce::error::FrameRejected;
use crate::allreduce::expect::{FrameSchedule, PlannedFrame, RingShape};

/// Steps behind the newest local all-reduce for which a frame may still start a slot (and a
/// slot held ahead is kept). Every all-reduce of step `s` ends before any of step `s + 1`
/// starts, so a frame for a step further behind with no running all-reduce names a bucket that
/// does not exist (or came very late): refused, and what is held for it dropped.
pub(super) const LATE_STEPS: u64 = 1;

/// Steps ahead of the newest local all-reduce for which a frame may be held: the left neighbour
/// cannot finish an all-reduce without this worker's share, so while this worker is at step `s`
/// the left one can have finished step `s` at most and be running step `s + 1`.
pub(super) const EARLY_STEPS: u64 = 1;

/// Identifies one all-reduce within the current job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct SlotKey {
    /// Membership generation.
    pub(super) generation: u64,
    /// Training step.
    pub(super) step: u64,
    /// Gradient bucket.
    pub(super) bucket: u32,
}

/// One all-reduce not started here, and the shape its frames were sent for: the buffer
/// length (elements), the wire dtype and the collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct AheadKey {
    /// The all-reduce.
    pub(super) key: SlotKey,
    /// Sender's buffer length, elements.
    pub(super) total_len: u64,
    /// How the elements travel.
    pub(super) dtype: WireDtype,
    /// The collective the sender runs.
    pub(super) collective: Collective,
}

/// The ring the mailbox serves, as the admission sees it.
pub(super) struct MembershipView<'a> {
    /// Job id from the coordinator.
    pub(super) job_id: &'a str,
    /// Membership generation.
    pub(super) generation: u64,
    /// This worker's place in the ring, for the receive plans.
    pub(super) shape: RingShape,
}

/// One all-reduce's frames, as the admission sees them.
#[derive(Clone, Copy)]
pub(super) struct SlotView<'a> {
    /// The frames expected.
    pub(super) schedule: &'a FrameSchedule,
    /// Planned frames accepted so far (their [`PlannedFrame::index`]).
    pub(super) seen: &'a HashSet<usize>,
}

/// What the admission reads of the mailbox's state.
pub(super) trait AdmissionState {
    /// The ring served now; `None` before the first.
    fn membership(&self) -> Option<MembershipView<'_>>;
    /// Whether the all-reduce finished (or failed) here.
    fn is_finished(&self, key: &SlotKey) -> bool;
    /// The all-reduce's frames, when it runs here.
    fn running(&self, key: &SlotKey) -> Option<SlotView<'_>>;
    /// Frames held ahead for an all-reduce not started here, of that shape.
    fn held_ahead(&self, key: &AheadKey) -> Option<SlotView<'_>>;
    /// The newest step of an all-reduce started here in the current membership.
    fn newest_step(&self) -> Option<u64>;
}

/// Where an admitted frame goes.
pub(super) struct Admission {
    /// Its all-reduce.
    pub(super) key: SlotKey,
    /// Its place in that all-reduce's plan.
    pub(super) planned: PlannedFrame,
    /// Whether the local all-reduce has not started (the frame is held ahead, under the ahead
    /// budget, by the shape it was sent for).
    pub(super) ahead: bool,
    /// The plan of a slot the frame would create (`None` if the slot exists).
    pub(super) new_slot: Option<FrameSchedule>,
}

/// Checks a frame (of `elems` elements encoded as `dtype`) under the lock: its (job,
/// generation), its all-reduce's state, and that it is a planned frame not accepted before.
/// Changes nothing.
pub(super) fn admit(
    st: &impl AdmissionState,
    frame: &RingFrame,
    elems: usize,
    dtype: WireDtype,
    collective: Collective,
) -> Result<Admission, FrameRejected> {
    let m = st.membership().ok_or_else(|| FrameRejected::NotJoined {
        job_id: frame.job_id.clone(),
        generation: frame.generation,
    })?;
    if m.job_id != frame.job_id {
        return Err(FrameRejected::WrongJob {
            ours: m.job_id.to_string(),
            got: frame.job_id.clone(),
        });
    }
    if frame.generation < m.generation {
        return Err(FrameRejected::StaleGeneration {
            job_id: m.job_id.to_string(),
            got: frame.generation,
            current: m.generation,
        });
    }
    if frame.generation > m.generation {
        return Err(FrameRejected::NotJoined {
            job_id: frame.job_id.clone(),
            generation: frame.generation,
        });
    }
    let (step, bucket) = (frame.step, frame.bucket);
    let key = SlotKey {
        generation: frame.generation,
        step,
        bucket,
    };
    if st.is_finished(&key) {
        return Err(FrameRejected::Finished { step, bucket });
    }
    let unplanned = |reason: String| FrameRejected::Unplanned {
        step,
        bucket,
        reason,
    };
    // A running all-reduce checks the frame against its own shape; before it starts, frames
    // are held by the shape they were sent for ([`AheadKey`]), so none is refused here
    // for disagreeing with another frame.
    let running = st.running(&key);
    let existing = running.or_else(|| {
        st.held_ahead(&AheadKey {
            key,
            total_len: frame.total_len,
            dtype,
            collective,
        })
    });
    let new_slot = match &running {
        Some(slot) => {
            if slot.schedule.len() as u64 != frame.total_len {
                return Err(FrameRejected::LengthMismatch {
                    step,
                    bucket,
                    expected: slot.schedule.len(),
                    got: frame.total_len,
                });
            }
            if slot.schedule.dtype() != dtype {
                return Err(FrameRejected::DtypeMismatch {
                    step,
                    bucket,
                    expected: slot.schedule.dtype(),
                    got: dtype,
                });
            }
            if slot.schedule.collective() != collective {
                return Err(FrameRejected::CollectiveMismatch {
                    step,
                    bucket,
                    expected: slot.schedule.collective(),
                    got: collective,
                });
            }
            None
        }
        None if existing.is_some() => None,
        None => {
            if let Some(newest) = st.newest_step()
                && (step.saturating_add(LATE_STEPS) < newest
                    || step > newest.saturating_add(EARLY_STEPS))
            {
                return Err(FrameRejected::UnknownAllReduce {
                    step,
                    bucket,
                    newest,
                });
            }
            let len = usize::try_from(frame.total_len).map_err(|_| {
                FrameRejected::Malformed(format!("a buffer of {} f32", frame.total_len))
            })?;
            Some(FrameSchedule::new(m.shape, len, dtype, collective))
        }
    };
    let (schedule, ahead) = match (existing, &new_slot) {
        (Some(slot), _) => (slot.schedule, running.is_none()),
        (None, Some(schedule)) => (schedule, true),
        (None, None) => return Err(FrameRejected::Malformed("no plan".to_string())),
    };
    let planned = schedule
        .locate(frame.ring_step, frame.offset, elems)
        .map_err(unplanned)?;
    if ahead && frame.ring_step as usize >= schedule.early_steps_end() {
        return Err(unplanned(format!(
            "ring step {} before this worker started the {}: only ring steps below {} can come first",
            frame.ring_step,
            crate::allreduce::expect::collective_name(collective),
            schedule.early_steps_end()
        )));
    }
    if existing
        .as_ref()
        .is_some_and(|s| s.seen.contains(&planned.index))
    {
        return Err(FrameRejected::Duplicate {
            step,
            bucket,
            ring_step: frame.ring_step,
            offset: frame.offset,
        });
    }
    Ok(Admission {
        key,
        planned,
        ahead,
        new_slot,
    })
}
