//! Errors of the ring all-reduce: [`AllReduceError`] for callers of [`super::Ring`], and
//! [`FrameRejected`] for frames the [`super::Mailbox`] refuses (mapped to a gRPC status by the
//! service).

use std::time::Duration;

/// Why a ring all-reduce (or connecting the ring) failed. Messages name the peer rank and
/// address and the (step, bucket) where there is one.
#[derive(Debug, thiserror::Error)]
pub enum AllReduceError {
    /// The [`super::RingConfig`] is inconsistent (e.g. `rank >= world_size`).
    #[error("invalid ring config: {reason}")]
    InvalidConfig {
        /// What is wrong, naming the field.
        reason: String,
    },
    /// The right neighbour could not be connected to (or stayed unreachable) within the timeout.
    #[error(
        "ring peer rank {rank} at {addr} is unreachable (step {step}, bucket {bucket}): {reason}"
    )]
    PeerUnreachable {
        /// Rank of the peer.
        rank: u32,
        /// Its advertised address, `host:port`.
        addr: String,
        /// Step of the all-reduce (0 while connecting).
        step: u64,
        /// Bucket of the all-reduce (0 while connecting).
        bucket: u32,
        /// The transport's error.
        reason: String,
    },
    /// Nothing arrived from (or nothing was accepted by) a peer within the configured timeout.
    #[error(
        "timed out after {waited:?} waiting on ring peer rank {rank} at {addr} (step {step}, bucket {bucket}, {what})"
    )]
    Timeout {
        /// Rank of the peer we waited on.
        rank: u32,
        /// Its advertised address.
        addr: String,
        /// Step of the all-reduce.
        step: u64,
        /// Bucket of the all-reduce.
        bucket: u32,
        /// How long we waited without progress.
        waited: Duration,
        /// What we waited for ("a frame from the left neighbour", "the right neighbour to accept a frame").
        what: &'static str,
    },
    /// This ring's (job, generation) is no longer the one the worker's mailbox serves, or a peer
    /// is at another generation.
    #[error(
        "stale generation for job {job_id}: this ring is generation {ours}, {detail} (step {step}, bucket {bucket})"
    )]
    StaleGeneration {
        /// The job.
        job_id: String,
        /// Our generation.
        ours: u64,
        /// Where the other generation was seen (the mailbox or a peer's reply).
        detail: String,
        /// Step of the all-reduce (0 while connecting).
        step: u64,
        /// Bucket of the all-reduce (0 while connecting).
        bucket: u32,
    },
    /// A peer reduces a buffer of another length for the same (step, bucket).
    #[error(
        "length mismatch with ring peer rank {rank} at {addr} (step {step}, bucket {bucket}): we reduce {expected} f32, it sent {got}"
    )]
    LengthMismatch {
        /// Rank of the peer.
        rank: u32,
        /// Its advertised address.
        addr: String,
        /// Step of the all-reduce.
        step: u64,
        /// Bucket of the all-reduce.
        bucket: u32,
        /// Our length, f32 elements.
        expected: usize,
        /// The peer's length, f32 elements.
        got: u64,
    },
    /// A frame from the left neighbour does not fit the chunk plan (wrong offset, size, ring
    /// step or a duplicate).
    #[error(
        "bad frame from ring peer rank {rank} at {addr} (step {step}, bucket {bucket}): {reason}"
    )]
    BadFrame {
        /// Rank of the peer.
        rank: u32,
        /// Its advertised address.
        addr: String,
        /// Step of the all-reduce.
        step: u64,
        /// Bucket of the all-reduce.
        bucket: u32,
        /// What does not fit.
        reason: String,
    },
    /// The right neighbour answered a frame with an error status.
    #[error(
        "ring peer rank {rank} at {addr} refused a frame (step {step}, bucket {bucket}): {code:?}: {message}"
    )]
    Transport {
        /// Rank of the peer.
        rank: u32,
        /// Its advertised address.
        addr: String,
        /// Step of the all-reduce.
        step: u64,
        /// Bucket of the all-reduce.
        bucket: u32,
        /// The gRPC status code.
        code: tonic::Code,
        /// The status message.
        message: String,
    },
    /// An all-reduce with this (step, bucket) is already running, or already finished, here.
    #[error("all-reduce (step {step}, bucket {bucket}) already running or finished on this worker")]
    Duplicate {
        /// Step of the all-reduce.
        step: u64,
        /// Bucket of the all-reduce.
        bucket: u32,
    },
}

impl AllReduceError {
    /// Whether re-forming the ring (new generation) and retrying the step may succeed: true for
    /// peers that vanished or stalled, false for protocol and configuration errors.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::PeerUnreachable { .. } | Self::Timeout { .. } | Self::StaleGeneration { .. }
        )
    }
}

/// Why the [`super::Mailbox`] refused a frame. The service maps each to a gRPC code.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameRejected {
    /// The frame is malformed or too large (`INVALID_ARGUMENT`).
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// The frame's `total_len` differs from the running all-reduce's (`INVALID_ARGUMENT`).
    #[error(
        "length mismatch for step {step} bucket {bucket}: this worker reduces {expected} f32, frame says {got}"
    )]
    LengthMismatch {
        /// Step of the all-reduce.
        step: u64,
        /// Bucket of the all-reduce.
        bucket: u32,
        /// Local length, f32 elements.
        expected: usize,
        /// The frame's length, f32 elements.
        got: u64,
    },
    /// The frame's elements are encoded otherwise (`RingFrame.dtype`) than the all-reduce's
    /// other frames, or than this worker's all-reduce once it started (`INVALID_ARGUMENT`): the
    /// workers disagree on `train.allreduce_dtype`.
    #[error(
        "dtype mismatch for step {step} bucket {bucket}: this all-reduce travels as {expected:?}, frame is {got:?}"
    )]
    DtypeMismatch {
        /// Step of the all-reduce.
        step: u64,
        /// Bucket of the all-reduce.
        bucket: u32,
        /// The all-reduce's encoding.
        expected: keel_proto::ring_rpc::WireDtype,
        /// The frame's.
        got: keel_proto::ring_rpc::WireDtype,
    },
    /// The frame belongs to another collective (`RingFrame.collective`) than the other frames
    /// of its (step, bucket), or than this worker's once it started (`INVALID_ARGUMENT`): the
    /// workers disagree on `train.shard_optimizer`.
    #[error(
        "collective mismatch for step {step} bucket {bucket}: this is {expected:?}, frame is {got:?}"
    )]
    CollectiveMismatch {
        /// Step of the collective.
        step: u64,
        /// Bucket of the collective.
        bucket: u32,
        /// The collective running (or planned) here.
        expected: keel_proto::ring_rpc::Collective,
        /// The frame's.
        got: keel_proto::ring_rpc::Collective,
    },
    /// No all-reduce with this (step, bucket) runs here or can still start: a bucket unknown
    /// at a step already past, or a step too far ahead (`INVALID_ARGUMENT`).
    #[error(
        "no all-reduce step {step} bucket {bucket} here: this worker is at step {newest} (an unknown bucket, or a step out of reach)"
    )]
    UnknownAllReduce {
        /// The frame's step.
        step: u64,
        /// The frame's bucket.
        bucket: u32,
        /// The newest step of an all-reduce started on this worker.
        newest: u64,
    },
    /// The frame is not one its all-reduce's receive plan expects from the left neighbour: a
    /// ring step out of range, an offset or length other than a planned frame's, or a ring
    /// step past the reduce-scatter before this worker started the all-reduce
    /// (`INVALID_ARGUMENT`).
    #[error("unplanned frame for step {step} bucket {bucket}: {reason}")]
    Unplanned {
        /// The frame's step.
        step: u64,
        /// The frame's bucket.
        bucket: u32,
        /// What does not fit the plan.
        reason: String,
    },
    /// This planned frame was accepted before (`ALREADY_EXISTS`: a sender whose earlier attempt
    /// failed in transit knows it landed after all).
    #[error(
        "duplicate frame for step {step} bucket {bucket}: ring step {ring_step} offset {offset} was accepted before"
    )]
    Duplicate {
        /// The frame's step.
        step: u64,
        /// The frame's bucket.
        bucket: u32,
        /// The frame's ring step.
        ring_step: u32,
        /// The frame's first element.
        offset: u64,
    },
    /// No ring is registered here yet, or only an older generation of this job (`UNAVAILABLE`:
    /// the sender retries until its timeout).
    #[error("this worker has not joined job {job_id} generation {generation} yet")]
    NotJoined {
        /// The frame's job.
        job_id: String,
        /// The frame's generation.
        generation: u64,
    },
    /// The frame belongs to another job (`NOT_FOUND`).
    #[error("this worker is in job {ours}, not {got}")]
    WrongJob {
        /// The job this worker's ring belongs to.
        ours: String,
        /// The frame's job.
        got: String,
    },
    /// The frame's generation is older than this worker's ring (`FAILED_PRECONDITION`).
    #[error("stale generation {got}: job {job_id} is at generation {current} here")]
    StaleGeneration {
        /// The job.
        job_id: String,
        /// The frame's generation.
        got: u64,
        /// The generation this worker is at.
        current: u64,
    },
    /// The all-reduce this frame belongs to already finished or failed here (`FAILED_PRECONDITION`).
    // "Failed" is the usual case behind this refusal (a bad frame or a timeout ended it here, and a
    // recovery is starting): saying only "finished" sent the blameless sender looking for a stale
    // generation (abuse case 3).
    #[error(
        "all-reduce step {step} bucket {bucket} already ended on this worker (finished, or failed here: then a recovery is starting)"
    )]
    Finished {
        /// Step of the all-reduce.
        step: u64,
        /// Bucket of the all-reduce.
        bucket: u32,
    },
}
