//! The sending side and the algorithm: ring reduce-scatter then all-gather, pipelined frame by
//! frame (Patarasuk and Yuan, JPDC 2009, section 3; the schedule Horovod and NCCL use).
//!
//! Shapes: the buffer is `[len]` f32, cut by [`chunk_plan`] into `n = world_size` chunks and each
//! chunk into frames of at most `frame_bytes / 4` elements ([`frame_plan`]), sent as f32 or, for
//! [`Ring::all_reduce_sum_as`] in bf16, as half as many bytes (see `bf16_wire`).
//!
//! A frame is forwarded as soon as it is reduced, so ring step `t + 1` of frame `k` overlaps
//! ring step `t` of frame `k + 1`: sending, receiving and adding run at the same time. Each
//! element's sum is always formed in the same order (starting at the chunk's owner and going
//! around the ring), so results are bit-identical on every run, and the all-gather copies the
//! finished chunks, so every rank ends with the same bytes.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use keel_proto::ring_rpc::{Collective, RingFrame, WireDtype};

use backon::{ExponentialBuilder, Retryable};
use tokio::time::{Instant, sleep_until, timeout, timeout_at};
use tonic::Code;

use super::absorb::{Outgoing, Payload, absorb_or_defer};
use super::bf16_wire::{self, element_bytes};
use super::config::RingConfig;
use super::error::AllReduceError;
use super::expect::{FrameSchedule, PlannedFrame, RingShape};
use super::mailbox::{InboundFrame, Mailbox};
use super::plan::{chunk_plan, frame_plan, send_chunk};
use super::shared_buf::SharedBuf;
use super::transport::{GrpcTransport, Link, Transport, before};

/// Frames in flight per stream of the link to the right neighbour.
const IN_FLIGHT_PER_STREAM: usize = 8;

/// One worker's membership in a ring: links to its right neighbour (over a [`Transport`]),
/// plus the mailbox where its left neighbour's frames arrive.
pub struct Ring {
    /// As given to [`Ring::connect`].
    cfg: RingConfig,
    /// Shared with the worker's ring service.
    mailbox: Arc<Mailbox>,
    /// `streams_per_link` links to the right neighbour (over gRPC: each its own connection;
    /// empty for world size 1).
    right: Vec<Box<dyn Link>>,
    /// Round-robin cursor over `right`.
    next_stream: AtomicUsize,
}

impl Ring {
    /// Joins the worker's mailbox to (job, generation) and opens `streams_per_link` HTTP/2
    /// connections to the right neighbour, with the mailbox's peer security (cluster token,
    /// TLS), retrying until `timeout` while it starts up: [`Ring::connect_over`] a
    /// [`GrpcTransport`].
    ///
    /// Errors: [`AllReduceError::InvalidConfig`], [`AllReduceError::StaleGeneration`] (the mailbox
    /// already serves a newer generation of this job), [`AllReduceError::PeerUnreachable`].
    pub async fn connect(cfg: RingConfig, mailbox: Arc<Mailbox>) -> Result<Ring, AllReduceError> {
        let transport = GrpcTransport::new(mailbox.peer_security().clone(), cfg.timeout);
        Self::connect_over(cfg, mailbox, &transport).await
    }

    /// Joins the worker's mailbox to (job, generation) and opens `streams_per_link` links to
    /// the right neighbour over `transport`, until `timeout`.
    ///
    /// Errors: as [`Ring::connect`].
    pub async fn connect_over(
        cfg: RingConfig,
        mailbox: Arc<Mailbox>,
        transport: &dyn Transport,
    ) -> Result<Ring, AllReduceError> {
        cfg.validate()?;
        mailbox.join(&cfg.job_id, cfg.generation, shape(&cfg))?;
        let mut right = Vec::new();
        if cfg.world_size > 1 {
            let (rank, addr) = right_neighbour(&cfg);
            let deadline = Instant::now() + cfg.timeout;
            for _ in 0..cfg.streams_per_link {
                let link = transport.connect(addr, deadline).await.map_err(|reason| {
                    AllReduceError::PeerUnreachable {
                        rank,
                        addr: addr.to_string(),
                        step: 0,
                        bucket: 0,
                        reason,
                    }
                })?;
                right.push(link);
            }
        }
        Ok(Ring {
            cfg,
            mailbox,
            right,
            next_stream: AtomicUsize::new(0),
        })
    }

    /// The configuration this ring was connected with.
    pub fn config(&self) -> &RingConfig {
        &self.cfg
    }

    /// Sum of `data` (`[len]` f32) across all ranks, returned in the same vector. Every rank
    /// calls it with the same (step, bucket) and the same `len`; on success every rank holds
    /// bit-identical sums. World size 1 returns at once. Runs `2 (n - 1)` ring steps; each rank
    /// sends and receives `2 (n - 1) / n * len * 4` bytes. The vector is taken so that frames
    /// can be sent from it without copying (see `shared_buf`).
    ///
    /// Errors: [`AllReduceError::Timeout`] (the left neighbour sent nothing, or the right one
    /// accepted nothing, for `timeout`), [`AllReduceError::PeerUnreachable`],
    /// [`AllReduceError::LengthMismatch`], [`AllReduceError::BadFrame`],
    /// [`AllReduceError::Transport`], [`AllReduceError::StaleGeneration`] (the worker joined a
    /// newer generation meanwhile), [`AllReduceError::Duplicate`]. On error the partial sums are
    /// dropped: the caller restores its gradient (rolls back the step).
    pub async fn all_reduce_sum(
        &self,
        step: u64,
        bucket: u32,
        data: Vec<f32>,
    ) -> Result<Vec<f32>, AllReduceError> {
        self.all_reduce_sum_as(step, bucket, data, WireDtype::F32)
            .await
    }

    /// [`Ring::all_reduce_sum`] with the elements sent as `dtype`. `F32` is that; `Bf16`
    /// sends half the bytes and returns sums rounded to bf16, the same on every rank (see
    /// `bf16_wire`): for gradients, never for counts or losses. Every rank must use the same
    /// `dtype` for a (step, bucket); a frame in another is refused ([`AllReduceError::BadFrame`]
    /// on the receiver).
    ///
    /// Errors: as [`Ring::all_reduce_sum`].
    pub async fn all_reduce_sum_as(
        &self,
        step: u64,
        bucket: u32,
        data: Vec<f32>,
        dtype: WireDtype,
    ) -> Result<Vec<f32>, AllReduceError> {
        self.collective(step, bucket, data, dtype, Collective::AllReduce)
            .await
    }

    /// Runs `collective` over `data` (`[len]` f32, the same `len` on every rank), as
    /// (step, bucket); every rank calls it with the same arguments but `data`.
    /// - [`Collective::AllReduce`]: as [`Ring::all_reduce_sum_as`].
    /// - [`Collective::ReduceScatter`]: the all-reduce's first `n - 1` ring steps. Only this
    ///   rank's chunk, [`owned_chunk`](super::owned_chunk), of the returned vector holds the sum (bit-identical to
    ///   the all-reduce's, in bf16 rounded as it rounds); the other chunks hold partial sums.
    ///   Each rank sends and receives `(n - 1) / n * len` elements.
    /// - [`Collective::AllGather`]: the all-reduce's last `n - 1` ring steps, each rank
    ///   starting from its chunk [`owned_chunk`](super::owned_chunk) of `data`: every rank returns the owners'
    ///   chunks, bit for bit (`dtype` must be `F32` for weights). The same traffic.
    ///
    /// World size 1 returns `data` at once.
    ///
    /// Errors: as [`Ring::all_reduce_sum`].
    pub async fn collective(
        &self,
        step: u64,
        bucket: u32,
        data: Vec<f32>,
        dtype: WireDtype,
        collective: Collective,
    ) -> Result<Vec<f32>, AllReduceError> {
        let n = self.cfg.world_size as usize;
        if n == 1 {
            return Ok(data);
        }
        let rank = self.cfg.rank as usize;
        let len = data.len();
        let buf = Arc::new(SharedBuf::new(data));
        let chunks = chunk_plan(len, n);
        let frame_elems = self.cfg.frame_bytes / 4;
        let schedule = FrameSchedule::new(shape(&self.cfg), len, dtype, collective);
        let expected = schedule.expected();
        // The first ring step this rank sends at: the reduce-scatter's first, or the
        // all-gather's (its own finished chunk).
        let first_step = super::expect::ring_steps(collective, n).start;
        // One flag per expected incoming frame (the mailbox refuses copies already; a backstop).
        let mut seen = vec![false; expected];
        let mut received = 0usize;

        let mut inbox = self.mailbox.open(
            &self.cfg.job_id,
            self.cfg.generation,
            step,
            bucket,
            len,
            dtype,
            collective,
        )?;
        let mut outbox: VecDeque<Outgoing> =
            frame_plan(chunks[send_chunk(rank, n, first_step)].clone(), frame_elems)
                .map(|range| Outgoing {
                    ring_step: first_step as u32,
                    offset: range.start,
                    payload: match dtype {
                        WireDtype::F32 => Payload::Buffer(range),
                        // SAFETY: nothing writes the buffer before the loop below.
                        WireDtype::Bf16 => {
                            Payload::Ready(bf16_wire::encode(unsafe { buf.read(range) }))
                        }
                    },
                })
                .collect();
        // Ranges of the buffer that frames queued in `outbox` or being sent will still read;
        // a frame that would write one of them waits in `deferred` until its send finished.
        let mut readers: Vec<Range<usize>> = outbox
            .iter()
            .filter_map(|o| match &o.payload {
                Payload::Buffer(r) => Some(r.clone()),
                Payload::Ready(_) => None,
            })
            .collect();
        let mut deferred: VecDeque<(InboundFrame, Range<usize>)> = VecDeque::new();
        let max_in_flight = self.right.len() * IN_FLIGHT_PER_STREAM;
        let mut sends = FuturesUnordered::new();
        let mut last_arrival = Instant::now();

        while received < expected || !outbox.is_empty() || !sends.is_empty() || !deferred.is_empty()
        {
            while sends.len() < max_in_flight {
                let Some(out) = outbox.pop_front() else { break };
                let (reads, payload) = match out.payload {
                    Payload::Buffer(range) => {
                        // SAFETY: `range` is in `readers` until this send finishes, and no
                        // frame writes a range in `readers` (see `writes_readers`).
                        let (bytes, released) = unsafe { SharedBuf::bytes(&buf, range.clone()) };
                        (Some((range, released)), bytes)
                    }
                    Payload::Ready(bytes) => (None, bytes),
                };
                let send = self.send(
                    step,
                    bucket,
                    out.ring_step,
                    len,
                    out.offset,
                    (dtype, collective),
                    payload,
                );
                let wait_for_copies = self.cfg.timeout;
                sends.push(async move {
                    let sent = send.await;
                    let Some((range, released)) = reads else {
                        return (None, sent.map(|_| ()), false);
                    };
                    // An acked frame was written by the connection that carried the ack, so
                    // nothing reads its range any more, unless an earlier attempt failed: that
                    // attempt's copies may still sit in the failed call's queues, so the range
                    // is free only once every copy of the payload is gone.
                    let stuck = matches!(sent, Ok(true))
                        && timeout(wait_for_copies, released).await.is_err();
                    (Some(range), sent.map(|_| ()), stuck)
                });
            }
            tokio::select! {
                biased;
                Some((reads, sent, stuck)) = sends.next(), if !sends.is_empty() => {
                    sent?;
                    if stuck {
                        return Err(self.timeout_error(
                            right_neighbour(&self.cfg),
                            step,
                            bucket,
                            "a failed call to the right neighbour to let go of a frame",
                        ));
                    }
                    // The send is over: nothing reads its range any more.
                    if let Some(range) = reads
                        && let Some(i) = readers.iter().position(|r| *r == range)
                    {
                        readers.swap_remove(i);
                    }
                    // Frames that waited for that range may go on now.
                    for _ in 0..deferred.len() {
                        let Some((frame, range)) = deferred.pop_front() else { break };
                        absorb_or_defer(n, dtype, collective, &buf, frame, range, &mut outbox, &mut readers, &mut deferred);
                    }
                }
                frame = inbox.recv(), if received < expected => {
                    let frame = frame.ok_or_else(|| AllReduceError::StaleGeneration {
                        job_id: self.cfg.job_id.clone(),
                        ours: self.cfg.generation,
                        detail: "this worker joined another generation during the all-reduce".into(),
                        step,
                        bucket,
                    })?;
                    let slot = self.check_frame(step, bucket, &schedule, &frame)?;
                    if std::mem::replace(&mut seen[slot.index], true) {
                        return Err(self.bad_frame(step, bucket, &frame, "duplicate frame".into()));
                    }
                    received += 1;
                    last_arrival = Instant::now();
                    absorb_or_defer(n, dtype, collective, &buf, frame, slot.range, &mut outbox, &mut readers, &mut deferred);
                    // Let the connections read and write before the next frame's add: on a
                    // one-thread runtime (`io_runtime`) a run of queued frames would otherwise
                    // keep the sockets unserved for as long as it lasts (measured: 64 MiB with
                    // 2 workers at 0.7 GB/s without this, 1.4 with it).
                    tokio::task::yield_now().await;
                }
                () = sleep_until(last_arrival + self.cfg.timeout), if received < expected => {
                    return Err(self.timeout_error(
                        left_neighbour(&self.cfg),
                        step,
                        bucket,
                        "a frame from the left neighbour",
                    ));
                }
            }
        }
        Ok(SharedBuf::into_vec(buf))
    }

    /// Fault injection for tests: the error this rank's all-reduce of (step, bucket) fails with
    /// when its left neighbour sends a frame that matches no planned frame
    /// ([`AllReduceError::BadFrame`], naming the neighbour and "fault injection").
    pub fn injected_bad_frame(&self, step: u64, bucket: u32) -> AllReduceError {
        self.bad_frame_from_left(
            step,
            bucket,
            "fault injection: a frame that matches no planned frame".into(),
        )
    }

    /// [`AllReduceError::Timeout`]: waited `timeout` on `peer` (rank, address) for `what`.
    fn timeout_error(
        &self,
        (rank, addr): (u32, &str),
        step: u64,
        bucket: u32,
        what: &'static str,
    ) -> AllReduceError {
        AllReduceError::Timeout {
            rank,
            addr: addr.to_string(),
            step,
            bucket,
            waited: self.cfg.timeout,
            what,
        }
    }

    /// Finds where an incoming frame belongs in the plan (the mailbox checked it against the
    /// same plan; checked again here, as the all-reduce's own guard).
    fn check_frame(
        &self,
        step: u64,
        bucket: u32,
        schedule: &FrameSchedule,
        frame: &InboundFrame,
    ) -> Result<PlannedFrame, AllReduceError> {
        let len = schedule.len();
        if frame.total_len != len as u64 {
            let (rank, addr) = left_neighbour(&self.cfg);
            return Err(AllReduceError::LengthMismatch {
                rank,
                addr: addr.to_string(),
                step,
                bucket,
                expected: len,
                got: frame.total_len,
            });
        }
        if frame.dtype != schedule.dtype() {
            let reason = format!(
                "its elements are {:?}, this all-reduce's are {:?} (do the workers disagree on train.allreduce_dtype?)",
                frame.dtype,
                schedule.dtype()
            );
            return Err(self.bad_frame(step, bucket, frame, reason));
        }
        if frame.collective != schedule.collective() {
            let reason = format!(
                "it belongs to a {}, this is a {} (do the workers disagree on train.shard_optimizer?)",
                super::expect::collective_name(frame.collective),
                super::expect::collective_name(schedule.collective())
            );
            return Err(self.bad_frame(step, bucket, frame, reason));
        }
        schedule
            .locate(
                frame.ring_step,
                frame.offset,
                frame.data.len() / element_bytes(frame.dtype),
            )
            .map_err(|reason| self.bad_frame(step, bucket, frame, reason))
    }

    fn bad_frame(
        &self,
        step: u64,
        bucket: u32,
        frame: &InboundFrame,
        reason: String,
    ) -> AllReduceError {
        let reason = format!("{reason} (frame says sender rank {})", frame.sender_rank);
        self.bad_frame_from_left(step, bucket, reason)
    }

    /// [`AllReduceError::BadFrame`] naming the left neighbour, which sent the frame.
    fn bad_frame_from_left(&self, step: u64, bucket: u32, reason: String) -> AllReduceError {
        let (rank, addr) = left_neighbour(&self.cfg);
        AllReduceError::BadFrame {
            rank,
            addr: addr.to_string(),
            step,
            bucket,
            reason,
        }
    }

    /// Pushes one frame to the right neighbour, retrying while it is not reachable or has not
    /// joined this generation yet, for at most `timeout`. Returns whether an attempt failed
    /// before the one that was accepted.
    #[allow(clippy::too_many_arguments)]
    async fn send(
        &self,
        step: u64,
        bucket: u32,
        ring_step: u32,
        total_len: usize,
        offset: usize,
        (dtype, collective): (WireDtype, Collective),
        data: Bytes,
    ) -> Result<bool, AllReduceError> {
        let stream = self.next_stream.fetch_add(1, Ordering::Relaxed) % self.right.len();
        let link = &self.right[stream];
        let frame = RingFrame {
            job_id: self.cfg.job_id.clone(),
            generation: self.cfg.generation,
            step,
            bucket,
            sender_rank: self.cfg.rank,
            ring_step,
            total_len: total_len as u64,
            offset: offset as u64,
            data,
            dtype: dtype.into(),
            collective: collective.into(),
        };
        let (rank, addr) = right_neighbour(&self.cfg);
        let deadline = Instant::now() + self.cfg.timeout;
        let mut retried = false;
        let tries = (move || link.push(frame.clone()))
            .retry(SEND_BACKOFF)
            .when(|status| may_heal(status.code()))
            .adjust(|_, pause| before(deadline, pause))
            .notify(|_, _| retried = true);
        let result = timeout_at(deadline, tries).await;
        let status = match result {
            Ok(Ok(())) => return Ok(retried),
            Ok(Err(status)) => status,
            Err(_) => {
                return Err(self.timeout_error(
                    (rank, addr),
                    step,
                    bucket,
                    "the right neighbour to accept a frame",
                ));
            }
        };
        match status.code() {
            // Still not healed, and the next try would come after the deadline.
            code if may_heal(code) => Err(AllReduceError::PeerUnreachable {
                rank,
                addr: addr.to_string(),
                step,
                bucket,
                reason: format!("{:?}: {}", status.code(), status.message()),
            }),
            // An earlier attempt, failed in transit as far as we saw, landed after all.
            Code::AlreadyExists if retried => Ok(true),
            // The receiver's all-reduce of this pair has ended. Either it succeeded, so it had
            // this frame, or it failed there (a bad frame, a timeout, a shutdown), and that
            // worker reports it and the coordinator suspends the ring. Either way there is
            // nothing to resend; failing here instead raced that report with a misleading
            // "stale generation" error of this blameless rank (abuse case 3).
            Code::Aborted => Ok(retried),
            Code::FailedPrecondition => Err(AllReduceError::StaleGeneration {
                job_id: self.cfg.job_id.clone(),
                ours: self.cfg.generation,
                detail: format!(
                    "ring peer rank {rank} at {addr} refused: {}",
                    status.message()
                ),
                step,
                bucket,
            }),
            code => Err(AllReduceError::Transport {
                rank,
                addr: addr.to_string(),
                step,
                bucket,
                code,
                message: status.message().to_string(),
            }),
        }
    }
}

/// Pauses between tries to push a frame the right neighbour could not take yet: 1 ms,
/// doubling up to 100 ms, until the ring's `timeout`.
const SEND_BACKOFF: ExponentialBuilder = ExponentialBuilder::new()
    .with_min_delay(Duration::from_millis(1))
    .with_factor(2.0)
    .with_max_delay(Duration::from_millis(100))
    .without_max_times();

/// Whether a refused push may heal within the timeout: the receiver has not joined yet (still
/// in its previous job, `NotFound`, or fetching this job's files), or the connection is down.
fn may_heal(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled | Code::NotFound
    )
}

/// This worker's place in the ring, as the receive plans need it.
fn shape(cfg: &RingConfig) -> RingShape {
    RingShape {
        world_size: cfg.world_size as usize,
        rank: cfg.rank as usize,
        frame_elems: cfg.frame_bytes / 4,
    }
}

fn right_neighbour(cfg: &RingConfig) -> (u32, &str) {
    let rank = (cfg.rank + 1) % cfg.world_size;
    (rank, cfg.peers[rank as usize].as_str())
}

fn left_neighbour(cfg: &RingConfig) -> (u32, &str) {
    let rank = (cfg.rank + cfg.world_size - 1) % cfg.world_size;
    (rank, cfg.peers[rank as usize].as_str())
}
