//! The mailbox's admission check: whether a frame from the left neighbour may be taken, and
//! where it goes. A pure function of the mailbox's state under its lock (`super::Mailbox::deliver`
//! calls it before waiting for room and again after).

use keel_proto::ring_rpc::{Collective, RingFrame, WireDtype};

use super::{AheadKey, EARLY_STEPS, LATE_STEPS, SlotKey, State};
use crate::allreduce::error::FrameRejected;
use crate::allreduce::expect::{FrameSchedule, PlannedFrame};

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
    st: &State,
    frame: &RingFrame,
    elems: usize,
    dtype: WireDtype,
    collective: Collective,
) -> Result<Admission, FrameRejected> {
    let m = st
        .membership
        .as_ref()
        .ok_or_else(|| FrameRejected::NotJoined {
            job_id: frame.job_id.clone(),
            generation: frame.generation,
        })?;
    if m.job_id != frame.job_id {
        return Err(FrameRejected::WrongJob {
            ours: m.job_id.clone(),
            got: frame.job_id.clone(),
        });
    }
    if frame.generation < m.generation {
        return Err(FrameRejected::StaleGeneration {
            job_id: m.job_id.clone(),
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
    if st.finished.contains(&key) {
        return Err(FrameRejected::Finished { step, bucket });
    }
    let unplanned = |reason: String| FrameRejected::Unplanned {
        step,
        bucket,
        reason,
    };
    // A running all-reduce checks the frame against its own shape; before it starts, frames
    // are held by the shape they were sent for (`super::AheadKey`), so none is refused here
    // for disagreeing with another frame.
    let running = st.slots.get(&key);
    let existing = running.or_else(|| {
        st.ahead.get(&AheadKey {
            key,
            total_len: frame.total_len,
            dtype,
            collective,
        })
    });
    let new_slot = match running {
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
            if let Some(newest) = st.newest_step
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
        (Some(slot), _) => (&slot.schedule, running.is_none()),
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
    if existing.is_some_and(|s| s.seen.contains(&planned.index)) {
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
