//! The receive side of the ring: frames pushed by the left neighbour land here and are routed to
//! the all-reduce they belong to, keyed by (generation, step, bucket) within the worker's job.
//!
//! Frames may arrive before the local all-reduce starts (the left neighbour is ahead); they are
//! buffered. The buffer is bounded in bytes: when it is full, `deliver` waits for room, which
//! holds back the sender's reply and so throttles it (the sender times out eventually, never the
//! receiver's memory). Every buffered frame holds its share of the byte budget until the
//! all-reduce has consumed it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use keel_proto::ring_rpc::RingFrame;
use keel_proto::security::ClientSecurity;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::error::{AllReduceError, FrameRejected};

/// Largest accepted frame payload, bytes (tonic's default message limit is 4 MiB in total).
pub const MAX_FRAME_BYTES: usize = 4 << 20;

/// Default bound on the bytes of frames held by a mailbox (buffered or queued for an all-reduce).
pub const DEFAULT_CAPACITY_BYTES: usize = 256 << 20;

/// How many finished (generation, step, bucket) keys are remembered, to refuse late frames.
const FINISHED_MEMORY: usize = 4096;

/// Steps behind the newest local all-reduce for which a frame may still start a slot. Every
/// all-reduce of step `s` ends before any of step `s + 1` starts, so a frame for a step further
/// behind with no slot names a bucket that does not exist (or came very late): refused.
const LATE_STEPS: u64 = 1;

/// Steps ahead of the newest local all-reduce for which a frame may be buffered: the left
/// neighbour cannot get further ahead, because every step needs this worker's share.
const EARLY_STEPS: u64 = 2;

/// Receives frames from the left neighbour and routes them to waiting all-reduces.
///
/// One per worker process, shared by the gRPC [`super::RingService`] and every [`super::Ring`]
/// the worker forms (one per generation).
pub struct Mailbox {
    /// Membership, open and buffered all-reduces; held only for short, non-async sections.
    state: Mutex<State>,
    /// Byte budget for frames held here (one permit per byte).
    budget: Arc<Semaphore>,
    /// Total of `budget`, bytes.
    capacity_bytes: usize,
    /// How [`super::Ring::connect`] calls the right neighbour (cluster token, TLS): the
    /// worker's ring identity, set once when the worker starts.
    peer_security: ClientSecurity,
}

/// What the mailbox knows, behind its lock.
#[derive(Default)]
struct State {
    /// The (job, generation) this worker's current ring serves; `None` before the first ring.
    membership: Option<Membership>,
    /// Frames per all-reduce, whether or not the local call has started yet.
    slots: HashMap<SlotKey, Slot>,
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
}

/// Identifies one all-reduce within the current job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct SlotKey {
    /// Membership generation.
    generation: u64,
    /// Training step.
    step: u64,
    /// Gradient bucket.
    bucket: u32,
}

/// The frames of one all-reduce.
struct Slot {
    /// Where `deliver` puts frames (unbounded: the byte budget bounds it).
    tx: mpsc::UnboundedSender<InboundFrame>,
    /// Taken by the local all-reduce when it starts; `None` while it runs.
    rx: Option<mpsc::UnboundedReceiver<InboundFrame>>,
    /// Length of the local buffer (f32 elements) once the local all-reduce has started.
    total_len: Option<usize>,
}

impl Slot {
    fn new() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Slot {
            tx,
            rx: Some(rx),
            total_len: None,
        }
    }
}

/// One accepted frame, as the all-reduce consumes it.
pub(crate) struct InboundFrame {
    /// Rank of the sender.
    pub sender_rank: u32,
    /// Ring step (reduce-scatter, then all-gather) the frame belongs to.
    pub ring_step: u32,
    /// Sender's buffer length, f32 elements.
    pub total_len: u64,
    /// First element of `data` in the buffer.
    pub offset: u64,
    /// f32 little-endian; a length that is a multiple of 4 (checked on delivery).
    pub data: Bytes,
    /// This frame's share of the mailbox's byte budget, released when the frame is dropped.
    _permit: OwnedSemaphorePermit,
}

impl Mailbox {
    /// A mailbox with the default byte bound ([`DEFAULT_CAPACITY_BYTES`]).
    pub fn new() -> Arc<Mailbox> {
        Self::with_capacity(DEFAULT_CAPACITY_BYTES)
    }

    /// A mailbox holding at most `capacity_bytes` of frames (raised to [`MAX_FRAME_BYTES`] if
    /// smaller, so any valid frame fits).
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
        Arc::new(Mailbox {
            state: Mutex::new(State::default()),
            budget: Arc::new(Semaphore::new(capacity_bytes)),
            capacity_bytes,
            peer_security,
        })
    }

    /// How rings joined through this mailbox call their right neighbour.
    pub fn peer_security(&self) -> &ClientSecurity {
        &self.peer_security
    }

    /// Bytes of frames currently held (buffered or not yet consumed).
    pub fn held_bytes(&self) -> usize {
        self.capacity_bytes - self.budget.available_permits()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the maps inconsistent: keep going.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Makes (job, generation) the ring this mailbox serves. Frames of other generations still
    /// buffered are dropped; all-reduces of older generations still running see their inbox
    /// close and fail with [`AllReduceError::StaleGeneration`].
    ///
    /// Errors: [`AllReduceError::StaleGeneration`] if this job is already at a newer generation.
    pub(crate) fn join(&self, job_id: &str, generation: u64) -> Result<(), AllReduceError> {
        let mut st = self.lock();
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
        });
        if same_job {
            st.slots.retain(|key, _| key.generation == generation);
        } else {
            // A new job starts its steps (and generations) from 0 again: what the previous
            // job left (buffered frames, finished keys) must not collide with it.
            st.slots.clear();
            st.finished.clear();
            st.finished_order.clear();
        }
        Ok(())
    }

    /// Checks a frame's (job, generation) and its all-reduce's state under the lock.
    fn admit(st: &State, frame: &RingFrame) -> Result<SlotKey, FrameRejected> {
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
        let key = SlotKey {
            generation: frame.generation,
            step: frame.step,
            bucket: frame.bucket,
        };
        if st.finished.contains(&key) {
            return Err(FrameRejected::Finished {
                step: frame.step,
                bucket: frame.bucket,
            });
        }
        if let Some(newest) = st.newest_step
            && !st.slots.contains_key(&key)
            && (frame.step.saturating_add(LATE_STEPS) < newest
                || frame.step > newest.saturating_add(EARLY_STEPS))
        {
            return Err(FrameRejected::UnknownAllReduce {
                step: frame.step,
                bucket: frame.bucket,
                newest,
            });
        }
        if let Some(expected) = st.slots.get(&key).and_then(|s| s.total_len)
            && expected as u64 != frame.total_len
        {
            return Err(FrameRejected::LengthMismatch {
                step: frame.step,
                bucket: frame.bucket,
                expected,
                got: frame.total_len,
            });
        }
        Ok(key)
    }

    /// Accepts one frame from the left neighbour: checks it, waits for room in the byte budget,
    /// and queues it for its all-reduce (started or not).
    ///
    /// Errors: [`FrameRejected`] (malformed, wrong job, stale or future generation, finished
    /// all-reduce, an all-reduce that cannot exist here (an unknown bucket of a past step, or a
    /// step out of reach), length mismatch); the service maps them to gRPC codes.
    pub async fn deliver(&self, frame: RingFrame) -> Result<(), FrameRejected> {
        let bytes = frame.data.len();
        if bytes == 0 || !bytes.is_multiple_of(4) || bytes > MAX_FRAME_BYTES {
            return Err(FrameRejected::Malformed(format!(
                "payload of {bytes} bytes: expected a positive multiple of 4 up to {MAX_FRAME_BYTES}"
            )));
        }
        let elems = (bytes / 4) as u64;
        if frame
            .offset
            .checked_add(elems)
            .is_none_or(|end| end > frame.total_len)
        {
            return Err(FrameRejected::Malformed(format!(
                "elements {}..{}+{elems} lie outside a buffer of {} f32",
                frame.offset, frame.offset, frame.total_len
            )));
        }
        Self::admit(&self.lock(), &frame)?;
        // Wait for room without holding the lock; a sender that gives up drops this future.
        let permits = u32::try_from(bytes)
            .map_err(|_| FrameRejected::Malformed(format!("payload of {bytes} bytes")))?;
        let permit = Arc::clone(&self.budget)
            .acquire_many_owned(permits)
            .await
            .map_err(|_| FrameRejected::Malformed("mailbox closed".to_string()))?;
        let mut st = self.lock();
        // Membership may have moved on while we waited.
        let key = Self::admit(&st, &frame)?;
        let slot = st.slots.entry(key).or_insert_with(Slot::new);
        let inbound = InboundFrame {
            sender_rank: frame.sender_rank,
            ring_step: frame.ring_step,
            total_len: frame.total_len,
            offset: frame.offset,
            data: frame.data,
            _permit: permit,
        };
        slot.tx.send(inbound).map_err(|_| FrameRejected::Finished {
            step: key.step,
            bucket: key.bucket,
        })
    }

    /// Starts receiving for the local all-reduce (job, generation, step, bucket) of `total_len`
    /// f32 elements; frames buffered so far come first.
    ///
    /// Errors: [`AllReduceError::StaleGeneration`] if the mailbox serves another (job,
    /// generation); [`AllReduceError::Duplicate`] if this all-reduce is running or finished here.
    pub(crate) fn open(
        self: &Arc<Self>,
        job_id: &str,
        generation: u64,
        step: u64,
        bucket: u32,
        total_len: usize,
    ) -> Result<Inbox, AllReduceError> {
        let mut st = self.lock();
        match &st.membership {
            Some(m) if m.job_id == job_id && m.generation == generation => {}
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
        }
        let key = SlotKey {
            generation,
            step,
            bucket,
        };
        if st.finished.contains(&key) {
            return Err(AllReduceError::Duplicate { step, bucket });
        }
        let slot = st.slots.entry(key).or_insert_with(Slot::new);
        let rx = slot
            .rx
            .take()
            .ok_or(AllReduceError::Duplicate { step, bucket })?;
        slot.total_len = Some(total_len);
        st.newest_step = Some(st.newest_step.map_or(step, |n| n.max(step)));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(step: u64, bucket: u32) -> RingFrame {
        RingFrame {
            job_id: "job-1".into(),
            generation: 1,
            step,
            bucket,
            sender_rank: 1,
            ring_step: 0,
            total_len: 4,
            offset: 0,
            data: vec![0u8; 16].into(),
        }
    }

    #[tokio::test]
    async fn frames_of_an_all_reduce_that_cannot_exist_are_refused_not_buffered() {
        let mailbox = Mailbox::new();
        mailbox.join("job-1", 1).unwrap();
        // Before the first local all-reduce any step may come first (a resumed job).
        mailbox.deliver(frame(40, 0)).await.unwrap();
        let _inbox = mailbox.open("job-1", 1, 5, 0, 4).unwrap();
        for (step, bucket) in [(3, 9), (1000, 0), (8, 0)] {
            let err = mailbox.deliver(frame(step, bucket)).await.unwrap_err();
            assert!(
                matches!(err, FrameRejected::UnknownAllReduce { newest: 5, .. }),
                "step {step} bucket {bucket}: {err}"
            );
        }
        let held = mailbox.held_bytes();
        for (step, bucket) in [(4, 9), (5, 1), (6, 0), (7, 0)] {
            mailbox.deliver(frame(step, bucket)).await.unwrap();
        }
        assert_eq!(mailbox.held_bytes(), held + 4 * 16);
        // A new generation starts afresh.
        mailbox.join("job-1", 2).unwrap();
        let mut f = frame(0, 0);
        f.generation = 2;
        mailbox.deliver(f).await.unwrap();
    }
}
