//! Ring all-reduce between workers over gRPC (or any [`Transport`]): reduce-scatter then all-gather, directly between
//! neighbours, pipelined frame by frame (Patarasuk and Yuan, JPDC 2009; as in Horovod/NCCL).
//!
//! # Layout
//! - `plan`: [`chunk_plan`] and [`frame_plan`], pure functions every rank evaluates alike.
//! - `expect`: the receive plan of one all-reduce, the frames a rank expects from its left
//!   neighbour (ring step, offset, length), which both the mailbox and the ring check against.
//! - `mailbox`: [`Mailbox`], the receive side: refuses frames outside the plan, buffers the
//!   others and routes them to the running all-reduce, bounded in bytes (frames of all-reduces
//!   not started here apart from the running ones).
//! - `service`: [`ring_service`] / [`RingDataPlane`], the gRPC `keel.ring.v1.Ring` service
//!   (`Ring/Stream` read straight from the HTTP/2 body; [`RingService`] for the rest).
//! - `shared_buf`: the buffer of one all-reduce, which frames are sent from without a copy.
//! - `wire`: `Ring/Stream` messages encoded and decoded without copying their payloads.
//! - `config`: [`RingConfig`], how a worker takes part in a ring, checked.
//! - `ring`: [`Ring`], the send side and the algorithm, written against a [`Transport`].
//! - `transport`: [`Transport`] and [`Link`], what the ring needs from the network, and
//!   [`GrpcTransport`], the HTTP/2 one jobs use.
//! - `memory`: [`MemoryNetwork`], peers' mailboxes in one process with injected faults
//!   ([`LinkFaults`]), for tests and simulations.
//! - `absorb`: what a received frame does to the buffer (add or copy) and what it passes on.
//! - `bf16_wire`: frames of bf16 elements (`train.allreduce_dtype = "bf16"`), summed in f32.
//! - `link`: one long-lived `Ring/Stream` call to the right neighbour, acked frame by frame,
//!   sent below tonic's codec (see `wire`).
//! - `error`: [`AllReduceError`] (callers), [`FrameRejected`] (wire).
//! - `bench`: `keel-worker bench-allreduce`.
//! - `fuzzing`: the mailbox's joining and starting, for the fuzz targets (hidden).
//!
//! # Protocol
//! 1. Each worker creates one [`Mailbox`] and serves [`ring_service`] on its tonic server (built
//!    with [`tune_server`]) at its advertised address.
//! 2. For each membership generation the coordinator gives every worker the same (job,
//!    generation, peers); each calls [`Ring::connect`], which makes the mailbox serve that
//!    (job, generation) and connects `streams_per_link` HTTP/2 connections to the right
//!    neighbour `(rank + 1) % n`.
//! 3. Every rank calls [`Ring::all_reduce_sum`] with the same (step, bucket, length). The buffer
//!    is cut into `n` chunks; rank r starts by pushing chunk r, frame by frame, to its right.
//! 4. Reduce-scatter, ring steps `0..n-1`: a frame received at step t is added to the local
//!    slice and pushed on at step t + 1. At step `n - 2` the sum is final: rank r then holds the
//!    sum of chunk `(r + 1) % n`.
//! 5. All-gather, ring steps `n-1..2(n-1)`: finished frames travel once more around the ring;
//!    each rank copies them and passes them on unchanged.
//! 6. Frames travel on `streams_per_link` long-lived `Ring/Stream` calls (one per connection).
//!    Every frame carries (job, generation, step, bucket, ring_step, offset, total length, the
//!    elements' dtype: f32, or bf16 for gradients with `train.allreduce_dtype = "bf16"`) and
//!    is acked, in order, once the receiver accepted it; refusals carry a status code:
//!    `INVALID_ARGUMENT` (malformed, length mismatch, a frame the receive plan does not expect,
//!    an all-reduce that cannot run here: an unknown bucket of a past step, a step more than one
//!    ahead), `ALREADY_EXISTS` (a copy of a frame accepted before), `NOT_FOUND` (other job),
//!    `FAILED_PRECONDITION` (older generation), `ABORTED` (the all-reduce ended there: nothing
//!    to resend), `UNAVAILABLE` (receiver has not joined the generation yet: retried).
//! 7. A rank that hears nothing from its left, or whose right accepts nothing, for `timeout`
//!    fails the all-reduce naming that peer; the coordinator then re-forms the ring with a new
//!    generation.
//!
//! # Use in a worker
//! ```ignore
//! let mailbox = Mailbox::new();
//! tune_server(Server::builder())
//!     .add_service(control_service)
//!     .add_service(ring_service(Arc::clone(&mailbox)))
//!     .serve_with_incoming(listener_stream); // at the worker's --listen address
//! // per generation, with the coordinator's (job, generation, rank, peers):
//! let ring = Ring::connect(RingConfig { streams_per_link: 2, frame_bytes: 512 << 10, .. }, Arc::clone(&mailbox)).await?;
//! let sums = ring.all_reduce_sum(step, bucket, grads).await?; // same (step, bucket, len) on every rank
//! ```
//! A connection lost in the middle of a frame may deliver it twice after the retry; the receiver
//! refuses the second copy with `ALREADY_EXISTS` rather than adding it twice, and a sender that
//! retried takes that as delivered.

mod absorb;
pub mod bench;
mod bf16_wire;
mod config;
mod error;
mod expect;
#[doc(hidden)]
pub mod fuzzing;
mod link;
mod mailbox;
mod memory;
mod plan;
mod ring;
mod service;
mod shared_buf;
mod transport;
mod wire;

pub use config::RingConfig;
pub use error::{AllReduceError, FrameRejected};
pub use keel_proto::ring_rpc::{Collective, WireDtype};
pub use mailbox::{DEFAULT_CAPACITY_BYTES, MAX_FRAME_BYTES, Mailbox};
pub use memory::{FaultCounts, LinkFaults, MemoryNetwork};
pub use plan::{chunk_plan, frame_count, frame_plan, owned_chunk, recv_chunk, send_chunk};
pub use ring::Ring;
pub use service::{AckStream, RingDataPlane, RingService, ring_service};
pub use transport::{Ack, GrpcTransport, Link, Transport};
pub use wire::MAX_MESSAGE_BYTES;

/// HTTP/2 stream flow-control window, bytes (16 MiB windows gained 20-40% when measured).
pub const STREAM_WINDOW_BYTES: u32 = 16 << 20;
/// HTTP/2 connection flow-control window, bytes.
pub const CONNECTION_WINDOW_BYTES: u32 = 32 << 20;
/// HTTP/2 maximum frame size, bytes (the protocol's ceiling is 16 MiB - 1).
pub const H2_MAX_FRAME_BYTES: u32 = 1 << 20;

/// Applies the HTTP/2 settings the ring needs for throughput (windows, frame size, no Nagle) to
/// a tonic server builder. The worker's one server (control + ring services) should be built as
/// `tune_server(Server::builder())`.
pub fn tune_server<L>(server: tonic::transport::Server<L>) -> tonic::transport::Server<L> {
    server
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .max_frame_size(H2_MAX_FRAME_BYTES)
        .tcp_nodelay(true)
}
