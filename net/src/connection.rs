//! One accepted connection, as [`crate::incoming::Incoming`] hands it to the server: it holds
//! a slot of the server's connection cap until it is dropped or evicted ([`crate::slots`]),
//! and fails its reads and writes (so that the server closes it) when the peer is too slow,
//! silent, has not proved the token in time, or was evicted.
//!
//! - Handshake: a peer must send the 24 bytes of the HTTP/2 client preface within the
//!   handshake timeout of the accept. Under TLS these bytes are the start of the TLS handshake,
//!   which tonic bounds separately (the same timeout, set by
//!   [`crate::security::ServerSecurity::server`]).
//! - Idle: after the preface, a connection whose peer has sent nothing for the idle timeout is
//!   closed. Live peers are never idle for long: the server pings every
//!   [`crate::incoming::KEEPALIVE_INTERVAL`] and an HTTP/2 peer answers each ping.
//!
//! - Proof: on a gRPC port a connection that has made no call with the cluster token within
//!   the auth timeout of its accept is closed, whatever it sends (pings, answers to pings,
//!   calls without the token). It may be evicted sooner to make room ([`crate::slots`]).
//! - Eviction: an evicted connection's reads and writes fail once its linger has passed (at
//!   once on gRPC ports; on the HTTP port, time to finish the request it is serving).
//!
//! Only bytes received count as traffic: the server's own pings and replies do not keep a
//! connection open.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::ratelimit::LogLimit;
use crate::slots::{Proof, Slot, SlotGuard};

/// Bytes of the HTTP/2 client connection preface (RFC 9113 §3.4:
/// `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
pub const PREFACE_BYTES: usize = 24;

/// At most one line per this interval about connections closed for slowness.
static CLOSED_LOG: LogLimit = LogLimit::new(Duration::from_secs(10));

/// The timeouts of one connection (from [`crate::incoming::ConnectionLimits`]).
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// Time the peer has for the preface.
    pub handshake: Duration,
    /// Time the peer may stay silent after the preface.
    pub idle: Duration,
    /// Time the peer has for its first call with the token; `None`: no proof is asked (the
    /// HTTP port, where Prometheus has no token).
    pub auth: Option<Duration>,
    /// Time an evicted connection may go on (to finish a request being served).
    pub linger: Duration,
}

/// What tonic puts in each request's extensions for a connection: its addresses and the
/// handle with which [`crate::auth::RequireToken`] marks it proven.
#[derive(Clone, Debug)]
pub struct ConnInfo {
    /// Local and remote addresses.
    tcp: TcpConnectInfo,
    /// Marks the connection proven.
    proof: Proof,
}

impl ConnInfo {
    /// The peer's address, when the socket knows it.
    pub fn remote_addr(&self) -> Option<SocketAddr> {
        self.tcp.remote_addr()
    }

    /// The server's address of the connection.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Marks the connection proven: a call on it carried the cluster token.
    pub fn prove(&self) {
        self.proof.prove();
    }

    /// Whether the connection is proven.
    pub fn is_proven(&self) -> bool {
        self.proof.is_proven()
    }
}

/// Which timeout closes a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The HTTP/2 preface is not complete.
    Preface,
    /// The peer sent nothing for the idle timeout.
    Idle,
    /// No call with the token within the auth timeout.
    Proof,
    /// Evicted to make room.
    Evicted,
}

/// An accepted TCP connection with a slot of its server's connection cap and its timeouts.
#[derive(Debug)]
pub struct LimitedConnection {
    /// The socket.
    inner: TcpStream,
    /// The slot of the cap, given back when the connection is dropped.
    slot: SlotGuard,
    /// Local and remote addresses and the proof handle, for tonic's request extensions.
    info: ConnInfo,
    /// When the connection was accepted.
    accepted: Instant,
    /// When the peer last sent bytes.
    last_read: Instant,
    /// Preface bytes not yet received; 0 once the handshake phase is over.
    preface_left: usize,
    /// The timeouts.
    timeouts: Timeouts,
    /// Fires at the earliest moment a timeout can be due; re-armed lazily, so that traffic
    /// costs a clock read, not a timer update.
    deadline: Pin<Box<Sleep>>,
}

impl LimitedConnection {
    /// Wraps `inner`, accepted now, holding `slot` until dropped.
    pub fn new(inner: TcpStream, slot: SlotGuard, timeouts: Timeouts) -> LimitedConnection {
        let now = Instant::now();
        let info = ConnInfo {
            tcp: TcpConnectInfo {
                local_addr: inner.local_addr().ok(),
                remote_addr: inner.peer_addr().ok(),
            },
            proof: slot.proof(),
        };
        LimitedConnection {
            inner,
            slot,
            info,
            accepted: now,
            last_read: now,
            preface_left: PREFACE_BYTES,
            timeouts,
            deadline: Box::pin(tokio::time::sleep_until(now + timeouts.handshake)),
        }
    }

    /// The connection's slot (the HTTP port waits for its eviction).
    pub fn slot(&self) -> &std::sync::Arc<Slot> {
        self.slot.slot()
    }

    /// The socket (to read its options).
    pub fn get_ref(&self) -> &TcpStream {
        &self.inner
    }

    /// The peer's address, when the socket knows it.
    pub fn remote_addr(&self) -> Option<SocketAddr> {
        self.info.remote_addr()
    }

    /// When the current phase's timeout is due, and why.
    fn due(&self) -> (Instant, Phase) {
        let slot = self.slot.slot();
        if let Some(at) = slot.evicted_at() {
            return (at + self.timeouts.linger, Phase::Evicted);
        }
        let (mut due, mut phase) = if self.preface_left > 0 {
            (self.accepted + self.timeouts.handshake, Phase::Preface)
        } else {
            (self.last_read + self.timeouts.idle, Phase::Idle)
        };
        if let Some(auth) = self.timeouts.auth
            && !slot.is_proven()
            && self.accepted + auth < due
        {
            (due, phase) = (self.accepted + auth, Phase::Proof);
        }
        (due, phase)
    }

    /// The error closing the connection if its timeout has passed (checked before every
    /// read and write, so that a peer sending without pause is cut off too).
    fn expired(&self) -> Option<io::Error> {
        let (due, phase) = self.due();
        (due <= Instant::now()).then(|| self.timed_out(phase))
    }

    /// `Ready(Err(TimedOut))` if the current timeout has passed, else `Pending` with the
    /// timer (and the slot's eviction) registered to wake `cx` when it may have.
    fn poll_timeout(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        self.slot.slot().register(cx.waker());
        // The timer is re-armed lazily: it fires at the earliest due time it was set for, and
        // the due time is computed again then. An eviction (due time moved earlier) wakes the
        // task through the slot and re-arms it here. At most a few rounds: each either
        // returns or moves the timer to a due time in the future.
        for _ in 0..4 {
            let (due, phase) = self.due();
            if due <= Instant::now() {
                return Poll::Ready(self.timed_out(phase));
            }
            if self.deadline.deadline() > due {
                self.deadline.as_mut().reset(due);
            }
            if self.deadline.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.deadline.as_mut().reset(due);
        }
        // The clock stood still for four rounds: try again on the next poll.
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// The error that makes the server close this connection, logged (rate-limited).
    fn timed_out(&self, phase: Phase) -> io::Error {
        let remote = self
            .info
            .remote_addr()
            .map_or_else(|| "unknown".to_string(), |a| a.to_string());
        let why = match phase {
            Phase::Preface => format!(
                "sent {} of the {PREFACE_BYTES} bytes of the HTTP/2 preface in {} s",
                PREFACE_BYTES - self.preface_left,
                self.timeouts.handshake.as_secs_f64()
            ),
            Phase::Idle => format!("sent nothing for {} s", self.timeouts.idle.as_secs_f64()),
            Phase::Proof => format!(
                "made no call with the cluster token in {} s",
                self.timeouts.auth.unwrap_or_default().as_secs_f64()
            ),
            Phase::Evicted => {
                "was evicted to make room (it had made no call with the cluster token)".into()
            }
        };
        tracing::debug!(%remote, "closing connection: {why}");
        // Evictions are logged (rate-limited) by the accept loop.
        if phase != Phase::Evicted
            && let Some(suppressed) = CLOSED_LOG.check()
        {
            // `suppressed`: connections closed so since the last such line.
            tracing::info!(%remote, suppressed, "closing connection: {why}");
        }
        io::Error::new(io::ErrorKind::TimedOut, format!("peer {remote} {why}"))
    }

    /// Records `n` bytes received.
    fn received(&mut self, n: usize) {
        if n > 0 {
            self.last_read = Instant::now();
            self.preface_left = self.preface_left.saturating_sub(n);
        }
    }
}

impl AsyncRead for LimitedConnection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(e) = this.expired() {
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                this.received(buf.filled().len() - before);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => this.poll_timeout(cx).map(Err),
        }
    }
}

impl AsyncWrite for LimitedConnection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Some(e) = this.expired() {
            return Poll::Ready(Err(e));
        }
        match Pin::new(&mut this.inner).poll_write(cx, buf) {
            Poll::Pending => this.poll_timeout(cx).map(Err),
            ready => ready,
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Some(e) = this.expired() {
            return Poll::Ready(Err(e));
        }
        match Pin::new(&mut this.inner).poll_write_vectored(cx, bufs) {
            Poll::Pending => this.poll_timeout(cx).map(Err),
            ready => ready,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl Connected for LimitedConnection {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}
