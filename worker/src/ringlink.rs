//! The bridge between the math thread (blocking) and the ring all-reduce (async): the math
//! thread submits buffers and later waits for their sums; one task on the runtime runs the
//! all-reduces one after another in submission order, which is the same order on every rank.

use crate::allreduce::{AllReduceError, Collective, Ring, WireDtype};
use crate::control::JobControl;
use crate::faults::Faults;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// An all-reduce that failed, or the ring task that stopped.
#[derive(Debug, thiserror::Error)]
pub enum RingLinkError {
    /// The ring reported an error (it names the peer and step).
    #[error(transparent)]
    AllReduce(#[from] AllReduceError),
    /// The ring task is gone (the job is being torn down).
    #[error("the ring task stopped")]
    Closed,
    /// The job was stopped from outside (cancelled, suspended or shutting down) while this
    /// all-reduce was pending.
    #[error("the all-reduce was abandoned: the job was stopped")]
    Aborted,
}

/// One buffer to sum across ranks.
struct Request {
    step: u64,
    bucket: u32,
    data: Vec<f32>,
    /// How the elements travel (f32, or bf16 for gradients).
    dtype: WireDtype,
    /// All-reduce, reduce-scatter or all-gather.
    collective: Collective,
    /// Abandoned when the job is stopped (else it runs to its end or a ring error).
    abortable: bool,
    reply: oneshot::Sender<Result<(Vec<f32>, Duration), RingLinkError>>,
}

/// The math thread's handle on the ring.
#[derive(Debug, Clone)]
pub struct RingLink {
    tx: mpsc::UnboundedSender<Request>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Request(step {}, bucket {}, {} elems)",
            self.step,
            self.bucket,
            self.data.len()
        )
    }
}

/// A pending sum.
#[derive(Debug)]
pub struct RingReply {
    rx: oneshot::Receiver<Result<(Vec<f32>, Duration), RingLinkError>>,
}

impl RingReply {
    /// Blocks (the math thread) until the sum is back.
    ///
    /// Errors: [`RingLinkError`].
    pub fn wait(self) -> Result<Vec<f32>, RingLinkError> {
        match self.rx.blocking_recv() {
            Ok(Ok((data, _))) => Ok(data),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(RingLinkError::Closed),
        }
    }
}

impl RingLink {
    /// Starts the ring task on the current runtime; it ends when every `RingLink` is dropped.
    /// `busy` accumulates the seconds the ring spent in all-reduces (for metrics), in µs.
    /// Once `control` is stopped, the pending all-reduce and every later one fail at once with
    /// [`RingLinkError::Aborted`].
    ///
    /// `faults` (tests only; [`Faults::none`] otherwise): at its ring fault's step the first
    /// all-reduce, once per process ([`Faults::bad_frame_now`]), fails as if the left
    /// neighbour had sent a malformed frame ([`Ring::injected_bad_frame`]); the other ranks
    /// are left waiting for this one, as then. Once is what lets the recovered generation run
    /// the same step cleanly.
    pub fn spawn(
        ring: Arc<Ring>,
        busy: Arc<std::sync::atomic::AtomicU64>,
        control: Arc<JobControl>,
        faults: Faults,
    ) -> RingLink {
        let (tx, mut rx) = mpsc::unbounded_channel::<Request>();
        tokio::spawn(async move {
            while let Some(req) = rx.recv().await {
                let t0 = Instant::now();
                let result = if faults.bad_frame_now(req.step) {
                    tracing::warn!(
                        step = req.step,
                        bucket = req.bucket,
                        "fault injection: this all-reduce fails as on a malformed frame"
                    );
                    Err(RingLinkError::from(
                        ring.injected_bad_frame(req.step, req.bucket),
                    ))
                } else if req.abortable && control.is_stopped() {
                    Err(RingLinkError::Aborted)
                } else {
                    let run =
                        ring.collective(req.step, req.bucket, req.data, req.dtype, req.collective);
                    let stopped = async {
                        if req.abortable {
                            control.stopped().await
                        } else {
                            std::future::pending().await
                        }
                    };
                    tokio::select! {
                        r = run => r.map_err(RingLinkError::from),
                        () = stopped => Err(RingLinkError::Aborted),
                    }
                };
                let took = t0.elapsed();
                crate::telemetry::add_allreduce_time(took);
                busy.fetch_add(
                    took.as_micros() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
                let _ = req.reply.send(result.map(|data| (data, took)));
            }
        });
        RingLink { tx }
    }

    /// Queues `data` to be summed across ranks as (step, bucket), exactly (f32 on the wire).
    pub fn submit(&self, step: u64, bucket: u32, data: Vec<f32>) -> RingReply {
        self.submit_as(step, bucket, data, WireDtype::F32)
    }

    /// Queues `data` to be summed across ranks as (step, bucket), its elements sent as `dtype`
    /// (see [`Ring::all_reduce_sum_as`]: bf16 only for gradients).
    pub fn submit_as(&self, step: u64, bucket: u32, data: Vec<f32>, dtype: WireDtype) -> RingReply {
        self.submit_collective(step, bucket, data, dtype, Collective::AllReduce)
    }

    /// Queues `collective` over `data` as (step, bucket), its elements sent as `dtype` (see
    /// [`Ring::collective`]: after a reduce-scatter only this rank's chunk holds the sum; an
    /// all-gather fills every chunk from its owner).
    pub fn submit_collective(
        &self,
        step: u64,
        bucket: u32,
        data: Vec<f32>,
        dtype: WireDtype,
        collective: Collective,
    ) -> RingReply {
        self.submit_request(step, bucket, data, (dtype, collective), true)
    }

    /// [`RingLink::submit_collective`], not abandoned when the job is stopped: it ends with its
    /// result or a ring error (a peer gone: `timeout` at most). For the collectives inside a
    /// sharded update (`train::sharding`), which every rank that began it must finish, so that
    /// a stop between steps leaves every rank a whole step.
    pub fn submit_to_the_end(
        &self,
        step: u64,
        bucket: u32,
        data: Vec<f32>,
        dtype: WireDtype,
        collective: Collective,
    ) -> RingReply {
        self.submit_request(step, bucket, data, (dtype, collective), false)
    }

    fn submit_request(
        &self,
        step: u64,
        bucket: u32,
        data: Vec<f32>,
        (dtype, collective): (WireDtype, Collective),
        abortable: bool,
    ) -> RingReply {
        let (reply, rx) = oneshot::channel();
        // If the task is gone the reply sender is dropped and `wait` says Closed.
        let _ = self.tx.send(Request {
            step,
            bucket,
            data,
            dtype,
            collective,
            abortable,
            reply,
        });
        RingReply { rx }
    }

    /// Sums `data` across ranks and waits for the result (the math thread blocks).
    ///
    /// Errors: [`RingLinkError`].
    pub fn all_reduce(
        &self,
        step: u64,
        bucket: u32,
        data: Vec<f32>,
    ) -> Result<Vec<f32>, RingLinkError> {
        self.submit(step, bucket, data).wait()
    }
}
