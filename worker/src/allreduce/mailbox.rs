//! The receive side of the ring: frames pushed by the left neighbour land here and are routed to
//! the all-reduce they belong to, keyed by (generation, step, bucket) within the worker's job.
//!
//! Every frame must be one the all-reduce's receive plan expects ([`FrameSchedule`]: its ring
//! step, offset and length, once each); any other is refused before it holds memory.
//!
//! Frames may arrive before the local all-reduce starts (the left neighbour is ahead, by at most
//! one all-reduce: it cannot finish one without this rank's share). Such frames are held "ahead"
//! under their own byte budget, apart from the budget of running all-reduces, so frames of an
//! all-reduce that never starts here (a bucket that does not exist) cannot crowd out the ring's
//! real frames; and they can only be of the reduce-scatter (every later ring step carries this
//! rank's share). When a budget is full, `deliver` waits for room, which holds back the sender's
//! reply and so throttles it (the sender times out eventually, never the receiver's memory); a
//! frame waiting for room ahead goes on under the running budget once its all-reduce starts.
//! Frames held ahead are kept apart by the length, dtype and collective they were sent for:
//! the first frame of an all-reduce does not fix its shape (a wrong or forged frame for a
//! bucket that does not exist yet would otherwise get the real all-reduce refused). The local
//! start keeps the frames of its own shape and drops the rest.
//! Every held frame keeps its share of a budget until it is consumed, refused, or dropped: frames
//! held ahead for a step the worker has moved past (it can no longer start) and everything of
//! another generation are dropped.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet, VecDeque};
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use keel_net::security::ClientSecurity;
use keel_proto::ring_rpc::{Collective, RingFrame, WireDtype};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};

use super::bf16_wire::element_bytes;
use super::error::{AllReduceError, FrameRejected};
use super::expect::{FrameSchedule, RingShape};
use admit::{AdmissionState, AheadKey, EARLY_STEPS, LATE_STEPS, MembershipView, SlotKey, SlotView};

/// Largest accepted frame payload, bytes (tonic's default message limit is 4 MiB in total).
pub const MAX_FRAME_BYTES: usize = 4 << 20;

/// Default bound on the bytes of frames held by a mailbox for running all-reduces. Frames of
/// all-reduces not started here yet are bounded apart, by a quarter of it (see
/// [`Mailbox::with_capacity`]).
pub const DEFAULT_CAPACITY_BYTES: usize = 256 << 20;

/// How many finished (generation, step, bucket) keys are remembered, to refuse late frames.
const FINISHED_MEMORY: usize = 4096;

/// Receives frames from the left neighbour and routes them to waiting all-reduces.
///
/// One per worker process, shared by the gRPC [`super::RingService`] and every [`super::Ring`]
/// the worker forms (one per generation).
pub struct Mailbox {
    /// Membership, open and buffered all-reduces; held only for short, non-async sections.
    state: Mutex<State>,
    /// Byte budget for frames of all-reduces running here (one permit per byte).
    budget: Arc<Semaphore>,
    /// Total of `budget`, bytes.
    capacity_bytes: usize,
    /// Byte budget for frames held ahead, of all-reduces not started here yet.
    ahead: Arc<Semaphore>,
    /// Total of `ahead`, bytes.
    ahead_bytes: usize,
    /// Woken when an all-reduce starts or the membership changes: a frame waiting for room
    /// ahead checks again where it belongs.
    changed: Notify,
    /// How [`super::Ring::connect`] calls the right neighbour (cluster token, TLS): the
    /// worker's ring identity, set once when the worker starts.
    peer_security: ClientSecurity,
}

/// What the mailbox knows, behind its lock.
#[derive(Default)]
struct State {
    /// The (job, generation) this worker's current ring serves; `None` before the first ring.
    membership: Option<Membership>,
    /// Frames of the all-reduces running here.
    slots: HashMap<SlotKey, Slot>,
    /// Frames held ahead, of all-reduces not started here, by the shape they were sent for.
    ahead: HashMap<AheadKey, Slot>,
    /// All-reduces that finished (or failed) here: late frames for them are refused.
    finished: HashSet<SlotKey>,
    /// `finished` in insertion order, to forget the oldest first.
    finished_order: VecDeque<SlotKey>,
    /// The newest step of an all-reduce started here in the current membership (`None` before
    /// the first): frames far from it are refused rather than buffered.
    newest_step: Option<u64>,
}

/// The ring a worker is currently part of.
struct Membership {
    /// Job id from the coordinator.
    job_id: String,
    /// Membership generation.
    generation: u64,
    /// This worker's place in the ring, for the receive plans.
    shape: RingShape,
}

/// The frames of one all-reduce.
struct Slot {
    /// Where `deliver` puts frames (unbounded: the plan and the byte budgets bound it).
    tx: mpsc::UnboundedSender<InboundFrame>,
    /// Taken by the local all-reduce when it starts; `None` while it runs. While it is here,
    /// the slot is held ahead and its frames sit in the channel.
    rx: Option<mpsc::UnboundedReceiver<InboundFrame>>,
    /// The frames expected: of the local buffer's length once the local all-reduce started,
    /// before that of the length the first frame gave.
    schedule: FrameSchedule,
    /// Planned frames accepted so far (their [`PlannedFrame::index`]): a second copy is refused.
    seen: HashSet<usize>,
}

impl Slot {
    fn new(schedule: FrameSchedule) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Slot {
            tx,
            rx: Some(rx),
            schedule,
            seen: HashSet::new(),
        }
    }

    /// What the admission rules read of it.
    fn view(&self) -> SlotView<'_> {
        SlotView {
            schedule: &self.schedule,
            seen: &self.seen,
        }
    }
}

impl AdmissionState for State {
    fn membership(&self) -> Option<MembershipView<'_>> {
        self.membership.as_ref().map(|m| MembershipView {
            job_id: &m.job_id,
            generation: m.generation,
            shape: m.shape,
        })
    }

    fn is_finished(&self, key: &SlotKey) -> bool {
        self.finished.contains(key)
    }

    fn running(&self, key: &SlotKey) -> Option<SlotView<'_>> {
        self.slots.get(key).map(Slot::view)
    }

    fn held_ahead(&self, key: &AheadKey) -> Option<SlotView<'_>> {
        self.ahead.get(key).map(Slot::view)
    }

    fn newest_step(&self) -> Option<u64> {
        self.newest_step
    }
}

/// One accepted frame, as the all-reduce consumes it.
pub(crate) struct InboundFrame {
    /// Rank of the sender.
    pub sender_rank: u32,
    /// Ring step (reduce-scatter, then all-gather) the frame belongs to.
    pub ring_step: u32,
    /// Sender's buffer length, elements.
    pub total_len: u64,
    /// First element of `data` in the buffer.
    pub offset: u64,
    /// How `data` encodes the elements.
    pub dtype: WireDtype,
    /// The collective the sender runs.
    pub collective: Collective,
    /// The elements, little-endian in `dtype`; a whole number of them (checked on delivery).
    pub data: Bytes,
    /// This frame's share of the mailbox's byte budget, released when the frame is dropped.
    _permit: OwnedSemaphorePermit,
}

impl Mailbox {
    /// A mailbox with the default byte bound ([`DEFAULT_CAPACITY_BYTES`]).
    pub fn new() -> Arc<Mailbox> {
        Self::with_capacity(DEFAULT_CAPACITY_BYTES)
    }

    /// A mailbox holding at most `capacity_bytes` of frames for running all-reduces (raised to
    /// [`MAX_FRAME_BYTES`] if smaller, so any valid frame fits), and at most a quarter of that
    /// (at least [`MAX_FRAME_BYTES`]) for all-reduces not started here yet.
    pub fn with_capacity(capacity_bytes: usize) -> Arc<Mailbox> {
        Self::build(capacity_bytes, ClientSecurity::without_token())
    }

    /// A mailbox of [`DEFAULT_CAPACITY_BYTES`] whose rings call the right neighbour with
    /// `peer_security` (the cluster token, TLS): what a worker process uses. [`Mailbox::new`]
    /// and [`Mailbox::with_capacity`] call without a token, for servers that ask none.
    pub fn with_peer_security(peer_security: ClientSecurity) -> Arc<Mailbox> {
        Self::build(DEFAULT_CAPACITY_BYTES, peer_security)
    }

    fn build(capacity_bytes: usize, peer_security: ClientSecurity) -> Arc<Mailbox> {
        let capacity_bytes = capacity_bytes.clamp(MAX_FRAME_BYTES, Semaphore::MAX_PERMITS);
        let ahead_bytes = (capacity_bytes / 4).max(MAX_FRAME_BYTES);
        Arc::new(Mailbox {
            state: Mutex::new(State::default()),
            budget: Arc::new(Semaphore::new(capacity_bytes)),
            capacity_bytes,
            ahead: Arc::new(Semaphore::new(ahead_bytes)),
            ahead_bytes,
            changed: Notify::new(),
            peer_security,
        })
    }

    /// How rings joined through this mailbox call their right neighbour.
    pub fn peer_security(&self) -> &ClientSecurity {
        &self.peer_security
    }

    /// Bytes of frames currently held (buffered or not yet consumed), for running all-reduces
    /// and ahead together.
    pub fn held_bytes(&self) -> usize {
        self.capacity_bytes - self.budget.available_permits() + self.ahead_bytes
            - self.ahead.available_permits()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the maps inconsistent: keep going.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Makes (job, generation) the ring this mailbox serves, with this worker at `shape` in it
    /// (what the receive plans are cut by). Frames of other generations still buffered are
    /// dropped; all-reduces of older generations still running see their inbox close and fail
    /// with [`AllReduceError::StaleGeneration`]. Joining the current generation again changes
    /// nothing.
    ///
    /// Errors: [`AllReduceError::StaleGeneration`] if this job is already at a newer generation.
    pub(crate) fn join(
        &self,
        job_id: &str,
        generation: u64,
        shape: RingShape,
    ) -> Result<(), AllReduceError> {
        let result = Self::join_locked(&mut self.lock(), job_id, generation, shape);
        // Frames waiting for room ahead look again (and are refused if of another generation).
        self.changed.notify_waiters();
        result
    }

    fn join_locked(
        st: &mut State,
        job_id: &str,
        generation: u64,
        shape: RingShape,
    ) -> Result<(), AllReduceError> {
        if let Some(m) = &st.membership
            && m.job_id == job_id
        {
            if m.generation > generation {
                return Err(AllReduceError::StaleGeneration {
                    job_id: job_id.to_string(),
                    ours: generation,
                    detail: format!("this worker already joined generation {}", m.generation),
                    step: 0,
                    bucket: 0,
                });
            }
            if m.generation == generation {
                return Ok(());
            }
        }
        let same_job = st.membership.as_ref().is_some_and(|m| m.job_id == job_id);
        st.newest_step = None;
        st.membership = Some(Membership {
            job_id: job_id.to_string(),
            generation,
            shape,
        });
        if same_job {
            st.slots.retain(|key, _| key.generation == generation);
            st.ahead.retain(|held, _| held.key.generation == generation);
        } else {
            // A new job starts its steps (and generations) from 0 again: what the previous
            // job left (buffered frames, finished keys) must not collide with it.
            st.slots.clear();
            st.ahead.clear();
            st.finished.clear();
            st.finished_order.clear();
        }
        Ok(())
    }

    /// Accepts one frame from the left neighbour: checks it, waits for room in the byte budget
    /// (of running all-reduces, or ahead), and queues it for its all-reduce (started or not).
    ///
    /// Errors: [`FrameRejected`] (malformed, wrong job, stale or future generation, finished
    /// all-reduce, an all-reduce that cannot exist here (an unknown bucket of a past step, or a
    /// step out of reach), length mismatch, a frame its plan does not expect, a duplicate); the
    /// service maps them to gRPC codes. A refused frame holds nothing.
    pub async fn deliver(&self, frame: RingFrame) -> Result<(), FrameRejected> {
        let dtype = WireDtype::try_from(frame.dtype).map_err(|_| {
            FrameRejected::Malformed(format!(
                "dtype {}: expected 0 (f32) or 1 (bf16)",
                frame.dtype
            ))
        })?;
        let collective = Collective::try_from(frame.collective).map_err(|_| {
            FrameRejected::Malformed(format!(
                "collective {}: expected 0 (all-reduce), 1 (reduce-scatter) or 2 (all-gather)",
                frame.collective
            ))
        })?;
        let size = element_bytes(dtype);
        let bytes = frame.data.len();
        if bytes == 0 || !bytes.is_multiple_of(size) || bytes > MAX_FRAME_BYTES {
            return Err(FrameRejected::Malformed(format!(
                "payload of {bytes} bytes: expected a positive multiple of {size} ({dtype:?} elements) up to {MAX_FRAME_BYTES}"
            )));
        }
        let elems = bytes / size;
        if frame
            .offset
            .checked_add(elems as u64)
            .is_none_or(|end| end > frame.total_len)
        {
            return Err(FrameRejected::Malformed(format!(
                "elements {}..{}+{elems} lie outside a buffer of {} f32",
                frame.offset, frame.offset, frame.total_len
            )));
        }
        let permits = u32::try_from(bytes)
            .map_err(|_| FrameRejected::Malformed(format!("payload of {bytes} bytes")))?;
        let permit = loop {
            // Registered before looking, so a start between the look and the wait is not missed.
            let mut changed = pin!(self.changed.notified());
            changed.as_mut().enable();
            let ahead = admit::admit(&*self.lock(), &frame, elems, dtype, collective)?.ahead;
            // Wait for room without holding the lock; a sender that gives up drops this future.
            let budget = if ahead { &self.ahead } else { &self.budget };
            tokio::select! {
                permit = Arc::clone(budget).acquire_many_owned(permits) => {
                    break permit.map_err(|_| FrameRejected::Malformed("mailbox closed".to_string()))?;
                }
                // Its all-reduce started, or the membership changed: look again.
                () = &mut changed, if ahead => {}
            }
        };
        let mut st = self.lock();
        // Membership, the all-reduce or its frames may have moved on while we waited.
        let admission = admit::admit(&*st, &frame, elems, dtype, collective)?;
        let slot = if admission.ahead {
            let held = AheadKey {
                key: admission.key,
                total_len: frame.total_len,
                dtype,
                collective,
            };
            match st.ahead.entry(held) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => match admission.new_slot {
                    Some(schedule) => e.insert(Slot::new(schedule)),
                    None => return Err(FrameRejected::Malformed("slot vanished".to_string())),
                },
            }
        } else {
            st.slots
                .get_mut(&admission.key)
                .ok_or_else(|| FrameRejected::Malformed("slot vanished".to_string()))?
        };
        slot.seen.insert(admission.planned.index);
        let inbound = InboundFrame {
            sender_rank: frame.sender_rank,
            ring_step: frame.ring_step,
            total_len: frame.total_len,
            offset: frame.offset,
            dtype,
            collective,
            data: frame.data,
            _permit: permit,
        };
        slot.tx.send(inbound).map_err(|_| FrameRejected::Finished {
            step: admission.key.step,
            bucket: admission.key.bucket,
        })
    }

    /// Starts receiving for the local `collective` (job, generation, step, bucket) of
    /// `total_len` elements sent as `dtype`; frames held ahead for it come first. Frames held
    /// ahead for it with another length, dtype or collective are dropped (with a warning), as
    /// are frames held ahead for steps this worker has now moved past.
    ///
    /// Errors: [`AllReduceError::StaleGeneration`] if the mailbox serves another (job,
    /// generation); [`AllReduceError::Duplicate`] if this all-reduce is running or finished here.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn open(
        self: &Arc<Self>,
        job_id: &str,
        generation: u64,
        step: u64,
        bucket: u32,
        total_len: usize,
        dtype: WireDtype,
        collective: Collective,
    ) -> Result<Inbox, AllReduceError> {
        let mut st = self.lock();
        let shape = match &st.membership {
            Some(m) if m.job_id == job_id && m.generation == generation => m.shape,
            other => {
                let detail = match other {
                    Some(m) => format!(
                        "this worker's mailbox serves job {} generation {}",
                        m.job_id, m.generation
                    ),
                    None => "this worker's mailbox serves no ring".to_string(),
                };
                return Err(AllReduceError::StaleGeneration {
                    job_id: job_id.to_string(),
                    ours: generation,
                    detail,
                    step,
                    bucket,
                });
            }
        };
        let key = SlotKey {
            generation,
            step,
            bucket,
        };
        if st.finished.contains(&key) {
            return Err(AllReduceError::Duplicate { step, bucket });
        }
        if st.slots.contains_key(&key) {
            return Err(AllReduceError::Duplicate { step, bucket });
        }
        let newest = st.newest_step.map_or(step, |n| n.max(step));
        st.newest_step = Some(newest);
        let mine = AheadKey {
            key,
            total_len: total_len as u64,
            dtype,
            collective,
        };
        let mut held = None;
        for (other, slot) in st.ahead.extract_if(|k, _| k.key == key) {
            if other == mine {
                held = Some(slot);
            } else {
                // Sent for a buffer this all-reduce is not: a peer's mistake or a forgery.
                // Dropping them frees their budget; the real frames were kept apart.
                tracing::warn!(
                    step,
                    bucket,
                    frames = slot.seen.len(),
                    their_len = other.total_len,
                    their_dtype = ?other.dtype,
                    their_collective = ?other.collective,
                    total_len,
                    ?dtype,
                    ?collective,
                    "frames held ahead for another shape of this all-reduce dropped"
                );
            }
        }
        // An all-reduce held ahead for a step this far from the newest can no longer start here.
        st.ahead.retain(|k, _| {
            k.key.step.saturating_add(LATE_STEPS) >= newest
                && k.key.step <= newest.saturating_add(EARLY_STEPS)
        });
        let schedule = FrameSchedule::new(shape, total_len, dtype, collective);
        let mut slot = held.unwrap_or_else(|| Slot::new(schedule.clone()));
        let rx = slot
            .rx
            .take()
            .ok_or(AllReduceError::Duplicate { step, bucket })?;
        slot.schedule = schedule;
        st.slots.insert(key, slot);
        drop(st);
        // Frames waiting for room ahead for this all-reduce go on under the running budget.
        self.changed.notify_waiters();
        Ok(Inbox {
            rx,
            key,
            mailbox: Arc::clone(self),
        })
    }

    /// Forgets an all-reduce (dropping frames still queued) and refuses its late frames.
    fn close(&self, key: SlotKey) {
        let mut st = self.lock();
        st.slots.remove(&key);
        st.ahead.retain(|held, _| held.key != key);
        if st.finished.insert(key) {
            st.finished_order.push_back(key);
        }
        while st.finished_order.len() > FINISHED_MEMORY {
            if let Some(old) = st.finished_order.pop_front() {
                st.finished.remove(&old);
            }
        }
    }
}

/// The receiving end of one running all-reduce; closes it in the mailbox when dropped.
pub(crate) struct Inbox {
    /// Frames for this all-reduce, buffered ones first.
    rx: mpsc::UnboundedReceiver<InboundFrame>,
    /// Which all-reduce.
    key: SlotKey,
    /// To close the slot on drop.
    mailbox: Arc<Mailbox>,
}

impl Inbox {
    /// The next frame; `None` when the mailbox moved to another generation.
    pub(crate) async fn recv(&mut self) -> Option<InboundFrame> {
        self.rx.recv().await
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.mailbox.close(self.key);
    }
}

// The admission rules, a pure function of what `State` shows them (`admit::AdmissionState`).
#[path = "mailbox_admit.rs"]
mod admit;

#[cfg(test)]
#[path = "mailbox_tests.rs"]
mod tests;
