//! The seam between the ring's algorithm (`ring`) and the network, as gloo writes its
//! collectives against a transport: a [`Transport`] opens [`Link`]s to a peer, and a link
//! pushes one frame at a time and returns the receiver's answer.
//!
//! Two implementations:
//! - [`GrpcTransport`]: HTTP/2 `Ring/Stream` calls (`link`), with the cluster token and TLS of
//!   the worker's ring identity: what jobs use.
//! - [`MemoryNetwork`](super::MemoryNetwork): the peers' mailboxes in one process, with faults
//!   injected on the way (`memory`): tests and simulations run the real all-reduce,
//!   reduce-scatter and all-gather code on hundreds of ranks without a socket.
//!
//! Answers are the ring protocol's refusal codes (gRPC status codes, listed in the
//! `allreduce` module's protocol), so both transports answer alike: the in-memory one maps the
//! mailbox's refusals through the same `From<FrameRejected> for Status` as the gRPC service.

use std::time::Duration;

use futures::future::BoxFuture;
use keel_net::security::ClientSecurity;
use keel_proto::ring_rpc::RingFrame;
use tokio::time::{Instant, timeout_at};

use super::link::LinkStream;
use super::{CONNECTION_WINDOW_BYTES, H2_MAX_FRAME_BYTES, STREAM_WINDOW_BYTES};
use backon::{ExponentialBuilder, Retryable};

/// A receiver's answer to one frame: accepted, or refused with a status code and reason.
pub type Ack = Result<(), tonic::Status>;

/// One link to a peer (one stream of frames): pushes a frame and waits for its answer.
/// Several pushes may be in flight at once; their answers may come in any order.
///
/// The frame's payload may point into the buffer the ring is reducing (it is sent without a
/// copy): once a push has resolved, the receiver must not read those bytes any more (a network
/// has copied them by then). Copies still held by an attempt that failed are waited for by the
/// ring before it writes that range again.
pub trait Link: Send + Sync {
    /// Pushes `frame`; resolves with the receiver's answer, or `UNAVAILABLE` when the link
    /// failed before one came (the frame may or may not have landed: a retry that lands twice
    /// is refused with `ALREADY_EXISTS`).
    fn push(&self, frame: RingFrame) -> BoxFuture<'_, Ack>;
}

/// Opens links to the ring's peers.
pub trait Transport: Send + Sync {
    /// Opens one link to the peer at `addr` (`host:port`), retrying while the peer is not up
    /// yet, until `deadline`.
    ///
    /// Errors: why no link could be had (a bad address, nothing answered by the deadline), as
    /// the text of [`AllReduceError::PeerUnreachable`](super::AllReduceError).
    fn connect<'a>(
        &'a self,
        addr: &'a str,
        deadline: Instant,
    ) -> BoxFuture<'a, Result<Box<dyn Link>, String>>;
}

/// Pauses between tries to connect to a peer while it starts up: 5 ms, doubling up to 200 ms,
/// until the deadline.
pub(super) const CONNECT_BACKOFF: ExponentialBuilder = ExponentialBuilder::new()
    .with_min_delay(Duration::from_millis(5))
    .with_factor(2.0)
    .with_max_delay(Duration::from_millis(200))
    .without_max_times();

/// `pause` if waiting it still ends before `deadline`; else `None` (no more tries).
pub(super) fn before(deadline: Instant, pause: Option<Duration>) -> Option<Duration> {
    pause.filter(|p| Instant::now() + *p < deadline)
}

/// The ring over HTTP/2: each link is one connection carrying one long-lived `Ring/Stream`
/// call (`link`), with the flow-control windows and frame size the ring needs.
#[derive(Clone, Debug)]
pub struct GrpcTransport {
    /// The cluster token and TLS the calls carry.
    security: ClientSecurity,
    /// Longest wait for one TCP (and TLS) connection to open.
    connect_timeout: Duration,
}

impl GrpcTransport {
    /// Calls peers with `security`, giving each connection attempt up to `connect_timeout`.
    pub fn new(security: ClientSecurity, connect_timeout: Duration) -> GrpcTransport {
        GrpcTransport {
            security,
            connect_timeout,
        }
    }
}

impl Link for LinkStream {
    fn push(&self, frame: RingFrame) -> BoxFuture<'_, Ack> {
        Box::pin(LinkStream::push(self, frame))
    }
}

impl Transport for GrpcTransport {
    fn connect<'a>(
        &'a self,
        addr: &'a str,
        deadline: Instant,
    ) -> BoxFuture<'a, Result<Box<dyn Link>, String>> {
        Box::pin(async move {
            let endpoint = self
                .security
                .endpoint(addr)
                .map_err(|e| format!("bad address: {}", e.reason))?
                .connect_timeout(self.connect_timeout)
                .tcp_nodelay(true)
                .initial_stream_window_size(STREAM_WINDOW_BYTES)
                .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
                .max_frame_size(H2_MAX_FRAME_BYTES);
            let endpoint = &endpoint;
            let tries = (move || endpoint.connect())
                .retry(CONNECT_BACKOFF)
                .adjust(|_, pause| before(deadline, pause))
                .notify(|e, _| {
                    tracing::debug!(addr, error = %e, "ring peer not up yet, retrying");
                });
            match timeout_at(deadline, tries).await {
                Ok(Ok(channel)) => {
                    let link: Box<dyn Link> =
                        Box::new(LinkStream::spawn(self.security.wrap(channel)));
                    Ok(link)
                }
                Ok(Err(e)) => Err(format!("{e}: {e:?}")),
                Err(_) => Err(format!("no connection within {:?}", self.connect_timeout)),
            }
        })
    }
}
