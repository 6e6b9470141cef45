//! One accepted connection, as [`crate::incoming::Incoming`] hands it to the server: it holds
//! a slot of the server's connection cap until it is dropped, and fails its reads and writes
//! (so that the server closes it) when the peer is too slow or silent.
//!
//! - Handshake: a peer must send the 24 bytes of the HTTP/2 client preface within the
//!   handshake timeout of the accept. Under TLS these bytes are the start of the TLS handshake,
//!   which tonic bounds separately (the same timeout, set by
//!   [`crate::security::ServerSecurity::server`]).
//! - Idle: after the preface, a connection whose peer has sent nothing for the idle timeout is
//!   closed. Live peers are never idle for long: the server pings every
//!   [`crate::incoming::KEEPALIVE_INTERVAL`] and an HTTP/2 peer answers each ping.
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
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Instant, Sleep};
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::ratelimit::LogLimit;

/// Bytes of the HTTP/2 client connection preface (RFC 9113 §3.4:
/// `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
pub const PREFACE_BYTES: usize = 24;

/// At most one line per this interval about connections closed for slowness.
static CLOSED_LOG: LogLimit = LogLimit::new(Duration::from_secs(10));

/// An accepted TCP connection with a slot of its server's connection cap and its timeouts.
#[derive(Debug)]
pub struct LimitedConnection {
    /// The socket.
    inner: TcpStream,
    /// The slot of the cap, given back when the connection is dropped.
    _permit: OwnedSemaphorePermit,
    /// Local and remote addresses, for tonic's request extensions.
    info: TcpConnectInfo,
    /// When the connection was accepted.
    accepted: Instant,
    /// When the peer last sent bytes.
    last_read: Instant,
    /// Preface bytes not yet received; 0 once the handshake phase is over.
    preface_left: usize,
    /// Time the peer has for the preface.
    handshake_timeout: Duration,
    /// Time the peer may stay silent after the preface.
    idle_timeout: Duration,
    /// Fires at the earliest moment a timeout can be due; re-armed lazily, so that traffic
    /// costs a clock read, not a timer update.
    deadline: Pin<Box<Sleep>>,
}

impl LimitedConnection {
    /// Wraps `inner`, accepted now, holding `permit` until dropped.
    pub fn new(
        inner: TcpStream,
        permit: OwnedSemaphorePermit,
        handshake_timeout: Duration,
        idle_timeout: Duration,
    ) -> LimitedConnection {
        let now = Instant::now();
        let info = TcpConnectInfo {
            local_addr: inner.local_addr().ok(),
            remote_addr: inner.peer_addr().ok(),
        };
        LimitedConnection {
            inner,
            _permit: permit,
            info,
            accepted: now,
            last_read: now,
            preface_left: PREFACE_BYTES,
            handshake_timeout,
            idle_timeout,
            deadline: Box::pin(tokio::time::sleep_until(now + handshake_timeout)),
        }
    }

    /// The socket (to read its options).
    pub fn get_ref(&self) -> &TcpStream {
        &self.inner
    }

    /// The peer's address, when the socket knows it.
    pub fn remote_addr(&self) -> Option<SocketAddr> {
        self.info.remote_addr
    }

    /// When the current phase's timeout is due.
    fn due(&self) -> Instant {
        if self.preface_left > 0 {
            self.accepted + self.handshake_timeout
        } else {
            self.last_read + self.idle_timeout
        }
    }

    /// `Ready(Err(TimedOut))` if the current timeout has passed, else `Pending` with the
    /// timer registered to wake `cx` when it may have.
    fn poll_timeout(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        loop {
            if self.deadline.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let due = self.due();
            if due <= Instant::now() {
                return Poll::Ready(self.timed_out());
            }
            self.deadline.as_mut().reset(due);
        }
    }

    /// The error that makes the server close this connection, logged (rate-limited).
    fn timed_out(&self) -> io::Error {
        let remote = self
            .info
            .remote_addr
            .map_or_else(|| "unknown".to_string(), |a| a.to_string());
        let why = if self.preface_left > 0 {
            format!(
                "sent {} of the {PREFACE_BYTES} bytes of the HTTP/2 preface in {} s",
                PREFACE_BYTES - self.preface_left,
                self.handshake_timeout.as_secs_f64()
            )
        } else {
            format!("sent nothing for {} s", self.idle_timeout.as_secs_f64())
        };
        tracing::debug!(%remote, "closing connection: {why}");
        if let Some(suppressed) = CLOSED_LOG.check() {
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
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.info.clone()
    }
}
