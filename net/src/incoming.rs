//! The accepted side of a server's TCP connections: Keel's own accept loop, for
//! `Server::serve_with_incoming[_shutdown]`.
//!
//! - `TCP_NODELAY` on every accepted socket. tonic applies its `tcp_nodelay` setting only to
//!   listeners it binds itself; accepted sockets kept Nagle's algorithm, and the ring's acks and
//!   the control plane's small replies waited for the peer's delayed ACK (measured: 4 MiB
//!   all-reduces took ~45 ms instead of ~13 ms).
//! - A cap on open connections per server ([`ConnectionLimits::max_connections`]): each
//!   accepted connection holds a slot until it is dropped; over the cap a new connection is
//!   closed at once (the caller sees a reset or EOF at once rather than hanging), logged at most
//!   once per 10 s.
//! - Timeouts for the handshake and for silent peers ([`crate::connection`]).
//! - Back-off on accept errors: when the process is out of file descriptors (EMFILE, ENFILE)
//!   or kernel memory, accepting again at once fails again at once; tonic's loop retried
//!   immediately and spun a core. This loop sleeps 10 ms, doubling to 1 s, and logs at most
//!   once per 10 s.
//!
//! Without a token a stranger can open connections; these bounds keep them from holding the
//! server's file descriptors.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Sleep;
use tokio_stream::Stream;

use crate::connection::LimitedConnection;
use crate::ratelimit::LogLimit;

/// Default [`ConnectionLimits::max_connections`]: open connections per server. Well under the
/// usual open-file limit (1,024), which the data files of jobs also need.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
/// Default [`ConnectionLimits::handshake_timeout`], seconds.
pub const DEFAULT_HANDSHAKE_TIMEOUT_SECS: f64 = 10.0;
/// Default [`ConnectionLimits::idle_timeout`], seconds: several times
/// [`KEEPALIVE_INTERVAL`], so that a live peer (which answers every ping) is never idle.
pub const DEFAULT_IDLE_TIMEOUT_SECS: f64 = 120.0;
/// How often a server pings each connection (HTTP/2 PING): a live peer's answers are the
/// traffic that keeps a quiet connection (a ring link between steps, a watch stream) open.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long a server waits for a ping's answer before closing the connection. Generous: a
/// worker busy computing still answers from its runtime threads, but a loaded machine may
/// be slow.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(60);

/// First pause after an accept error that persists (out of descriptors), then doubled.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest pause after accept errors.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Connections accepted (or refused) in one poll before yielding to other tasks.
const ACCEPTS_PER_POLL: usize = 64;

/// At most one line per this interval about refused connections and about accept errors.
static REFUSED_LOG: LogLimit = LogLimit::new(Duration::from_secs(10));
static ACCEPT_ERROR_LOG: LogLimit = LogLimit::new(Duration::from_secs(10));

/// The bounds a server puts on the connections it accepts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConnectionLimits {
    /// Open connections at most; over it, new ones are closed at once.
    pub max_connections: usize,
    /// Time a peer has after the accept to send the 24-byte HTTP/2 preface.
    pub handshake_timeout: Duration,
    /// Time a peer may send nothing after the preface (longer than [`KEEPALIVE_INTERVAL`]).
    pub idle_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            handshake_timeout: Duration::from_secs_f64(DEFAULT_HANDSHAKE_TIMEOUT_SECS),
            idle_timeout: Duration::from_secs_f64(DEFAULT_IDLE_TIMEOUT_SECS),
        }
    }
}

/// A setting of [`ConnectionArgs`] out of range.
#[derive(Debug, thiserror::Error)]
pub enum LimitsError {
    /// A timeout that is not a positive, finite number of seconds.
    #[error("--{flag} must be a positive number of seconds, got {value}")]
    BadTimeout {
        /// The flag.
        flag: &'static str,
        /// The value given.
        value: f64,
    },
    /// A cap of 0 connections.
    #[error("--max-connections must be at least 1")]
    NoConnections,
}

/// The flags (and variables) every server binary takes for its [`ConnectionLimits`].
#[derive(clap::Args, Debug, Clone)]
pub struct ConnectionArgs {
    /// Open connections this server accepts at most; more are closed at once. Keep it under
    /// the open-file limit (`ulimit -n`).
    #[arg(long, env = "KEEL_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Seconds a new connection has to send the HTTP/2 preface (and finish TLS) before it is
    /// closed; on the HTTP port (`--metrics-listen`) also the time a request's headers may
    /// take.
    #[arg(long, env = "KEEL_HANDSHAKE_TIMEOUT", value_name = "SECONDS",
          default_value_t = DEFAULT_HANDSHAKE_TIMEOUT_SECS)]
    pub handshake_timeout: f64,
    /// Seconds a connection's peer may send nothing (not even an answer to the server's
    /// pings, sent every 30 s) before it is closed.
    #[arg(long, env = "KEEL_IDLE_TIMEOUT", value_name = "SECONDS",
          default_value_t = DEFAULT_IDLE_TIMEOUT_SECS)]
    pub idle_timeout: f64,
}

impl ConnectionArgs {
    /// The limits the flags give.
    ///
    /// Errors: [`LimitsError`] for a cap of 0 or a timeout that is not positive and finite.
    pub fn limits(&self) -> Result<ConnectionLimits, LimitsError> {
        if self.max_connections == 0 {
            return Err(LimitsError::NoConnections);
        }
        let seconds = |flag: &'static str, value: f64| {
            Duration::try_from_secs_f64(value)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or(LimitsError::BadTimeout { flag, value })
        };
        Ok(ConnectionLimits {
            max_connections: self.max_connections,
            handshake_timeout: seconds("handshake-timeout", self.handshake_timeout)?,
            idle_timeout: seconds("idle-timeout", self.idle_timeout)?,
        })
    }
}

/// The connections a listener accepts, bounded by [`ConnectionLimits`]; never yields an
/// error (accept errors are retried here, with back-off when they persist).
pub struct Incoming {
    /// The listening socket.
    listener: TcpListener,
    /// The bounds.
    limits: ConnectionLimits,
    /// One permit per connection that may still be opened.
    slots: Arc<Semaphore>,
    /// The pause after an accept error, while it runs.
    pause: Option<Pin<Box<Sleep>>>,
    /// The next pause's length.
    next_pause: Duration,
}

impl Incoming {
    /// The connections `listener` accepts, within `limits`.
    pub fn new(listener: TcpListener, limits: ConnectionLimits) -> Incoming {
        Incoming {
            listener,
            slots: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
            pause: None,
            next_pause: ACCEPT_BACKOFF_MIN,
        }
    }

    /// Connections open now (accepted and not yet dropped).
    pub fn open_connections(&self) -> usize {
        self.limits
            .max_connections
            .saturating_sub(self.slots.available_permits())
    }
}

/// Whether an accept error means the process or system is out of a resource (retrying at
/// once fails again), rather than one connection failing (retry at once).
fn is_resource_error(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

impl Stream for Incoming {
    type Item = Result<LimitedConnection, io::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        for _ in 0..ACCEPTS_PER_POLL {
            if let Some(pause) = &mut this.pause {
                if pause.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.pause = None;
            }
            let (stream, remote) = match this.listener.poll_accept(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(accepted)) => {
                    this.next_pause = ACCEPT_BACKOFF_MIN;
                    accepted
                }
                Poll::Ready(Err(e)) if is_resource_error(&e) => {
                    let pause = this.next_pause;
                    if let Some(suppressed) = ACCEPT_ERROR_LOG.check() {
                        // `suppressed`: accept errors not logged since the last line.
                        tracing::warn!(
                            suppressed,
                            open = this.open_connections(),
                            "cannot accept connections: {e}; retrying in {pause:?} (raise the \
                             open-file limit, `ulimit -n`, or lower --max-connections)"
                        );
                    }
                    this.pause = Some(Box::pin(tokio::time::sleep(pause)));
                    this.next_pause = (pause * 2).min(ACCEPT_BACKOFF_MAX);
                    continue;
                }
                Poll::Ready(Err(e)) => {
                    // One connection failed before we took it (reset, aborted): take the next.
                    tracing::debug!("accept: {e}");
                    continue;
                }
            };
            let Ok(permit) = this.slots.clone().try_acquire_owned() else {
                if let Some(suppressed) = REFUSED_LOG.check() {
                    // `suppressed`: connections refused since the last line.
                    tracing::warn!(
                        %remote,
                        suppressed,
                        max = this.limits.max_connections,
                        "connection refused: this server has --max-connections open"
                    );
                }
                drop(stream);
                continue;
            };
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!(%remote, "cannot set TCP_NODELAY: {e}");
            }
            return Poll::Ready(Some(Ok(LimitedConnection::new(
                stream,
                permit,
                this.limits.handshake_timeout,
                this.limits.idle_timeout,
            ))));
        }
        // A flood of refused connections: let the server's other tasks run, then go on.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// [`Incoming`] with the default limits (in-process servers: tests, benchmarks).
pub fn nodelay_incoming(listener: TcpListener) -> Incoming {
    Incoming::new(listener, ConnectionLimits::default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_stream::StreamExt;

    /// The regression: accepted sockets had Nagle on (tonic ignores `tcp_nodelay` with
    /// `serve_with_incoming`), which delayed ring acks by the peer's delayed ACK.
    #[tokio::test]
    async fn accepted_connections_have_nodelay() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = nodelay_incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(accepted.get_ref().nodelay().unwrap());
    }

    fn limits(max: usize, handshake_ms: u64, idle_ms: u64) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: max,
            handshake_timeout: Duration::from_millis(handshake_ms),
            idle_timeout: Duration::from_millis(idle_ms),
        }
    }

    #[tokio::test]
    async fn over_the_cap_connections_are_closed_and_slots_come_back_on_drop() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = Incoming::new(listener, limits(2, 60_000, 60_000));
        let _a = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _b = tokio::net::TcpStream::connect(addr).await.unwrap();
        let first = incoming.next().await.unwrap().unwrap();
        let _second = incoming.next().await.unwrap().unwrap();
        assert_eq!(incoming.open_connections(), 2);
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        // The third is closed by the accept loop (polled here until it has seen it).
        let mut byte = [0u8; 1];
        let closed = tokio::select! {
            r = c.read(&mut byte) => r,
            _ = incoming.next() => panic!("a third connection was let through"),
        };
        assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
        drop(first);
        assert_eq!(incoming.open_connections(), 1);
        let _d = tokio::net::TcpStream::connect(addr).await.unwrap();
        assert!(incoming.next().await.unwrap().is_ok());
    }

    #[tokio::test]
    async fn a_partial_preface_times_out_and_a_silent_peer_too() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = Incoming::new(listener, limits(8, 200, 400));
        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"PRI * HTTP/2.0").await.unwrap();
        let mut conn = incoming.next().await.unwrap().unwrap();
        let mut buf = [0u8; 64];
        let started = std::time::Instant::now();
        let n = conn.read(&mut buf).await.unwrap();
        assert_eq!(n, 14);
        let err = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(err.to_string().contains("14 of the 24"), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(150));

        // A full preface, then silence: closed after the idle timeout.
        let mut quiet = tokio::net::TcpStream::connect(addr).await.unwrap();
        quiet
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let mut conn = incoming.next().await.unwrap().unwrap();
        let mut got = 0;
        while got < crate::connection::PREFACE_BYTES {
            got += conn.read(&mut buf).await.unwrap();
        }
        let started = std::time::Instant::now();
        // Traffic keeps it open past the idle timeout...
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            quiet.write_all(b"x").await.unwrap();
            assert_eq!(conn.read(&mut buf).await.unwrap(), 1);
        }
        assert!(started.elapsed() > Duration::from_millis(700));
        // ...silence closes it.
        let err = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(err.to_string().contains("sent nothing"), "{err}");
    }

    #[test]
    fn flags_out_of_range_are_refused() {
        let args = |max, h, i| ConnectionArgs {
            max_connections: max,
            handshake_timeout: h,
            idle_timeout: i,
        };
        assert_eq!(args(3, 0.5, 2.0).limits().unwrap(), limits(3, 500, 2000));
        assert!(args(0, 1.0, 1.0).limits().is_err());
        assert!(args(1, 0.0, 1.0).limits().is_err());
        assert!(args(1, 1.0, f64::NAN).limits().is_err());
        assert!(args(1, -1.0, 1.0).limits().is_err());
        assert!(args(1, 1.0, f64::INFINITY).limits().is_err());
    }
}
