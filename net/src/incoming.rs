//! The accepted side of a server's TCP connections: Keel's own accept loop, for
//! `Server::serve_with_incoming[_shutdown]`.
//!
//! - `TCP_NODELAY` on every accepted socket. tonic applies its `tcp_nodelay` setting only to
//!   listeners it binds itself; accepted sockets kept Nagle's algorithm, and the ring's acks and
//!   the control plane's small replies waited for the peer's delayed ACK (measured: 4 MiB
//!   all-reduces took ~45 ms instead of ~13 ms).
//! - A cap on open connections per server ([`ConnectionLimits::max_connections`]): each
//!   accepted connection holds a slot until it is dropped. Slots go to those who prove
//!   themselves ([`crate::slots`]): connections that have made no call with the cluster token
//!   hold at most [`ConnectionLimits::max_unauthenticated`] of them and are evicted, oldest
//!   first, to make room for a new connection; only when every slot is held by a proven
//!   connection is a new one closed at once (the caller sees a reset or EOF at once rather
//!   than hanging). Both are logged at most once per 10 s.
//! - Timeouts for the handshake, for the first call with the token and for silent peers
//!   ([`crate::connection`]).
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
use tokio::time::Sleep;
use tokio_stream::Stream;

use crate::connection::{LimitedConnection, Timeouts};
use crate::ratelimit::LogLimit;
use crate::slots::{Admission, SlotPool};

/// Default [`ConnectionLimits::max_connections`]: open connections per server. Well under the
/// usual open-file limit (1,024), which the data files of jobs also need.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
/// Default [`ConnectionLimits::max_unauthenticated`]: the whole cap. A proven connection never
/// lacks room (a newcomer evicts an unproven one), so a smaller budget would only shorten the
/// time a newcomer has to make its first call while strangers on its own address (every
/// process of a local cluster is on 127.0.0.1) open connections: it can be evicted once this
/// many newer connections have arrived.
pub const DEFAULT_MAX_UNAUTHENTICATED: usize = DEFAULT_MAX_CONNECTIONS;
/// Default [`ConnectionLimits::handshake_timeout`], seconds.
pub const DEFAULT_HANDSHAKE_TIMEOUT_SECS: f64 = 10.0;
/// Default [`ConnectionLimits::auth_timeout`], seconds: `keel`, the workers and ring peers
/// make their first call right after connecting; pings and calls without the token do not
/// extend it.
pub const DEFAULT_AUTH_TIMEOUT_SECS: f64 = 10.0;
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
static EVICTED_LOG: LogLimit = LogLimit::new(Duration::from_secs(10));
static ACCEPT_ERROR_LOG: LogLimit = LogLimit::new(Duration::from_secs(10));

/// The bounds a server puts on the connections it accepts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConnectionLimits {
    /// Open connections at most; over it, an unauthenticated one is evicted, or, when all
    /// are authenticated, the new one is closed at once.
    pub max_connections: usize,
    /// Connections without a call with the token yet, at most (strangers cannot hold more).
    pub max_unauthenticated: usize,
    /// Time a peer has after the accept to send the 24-byte HTTP/2 preface.
    pub handshake_timeout: Duration,
    /// Time a peer has after the accept to make a call with the cluster token (gRPC ports).
    pub auth_timeout: Duration,
    /// Time a peer may send nothing after the preface (longer than [`KEEPALIVE_INTERVAL`]).
    pub idle_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_unauthenticated: DEFAULT_MAX_UNAUTHENTICATED,
            handshake_timeout: Duration::from_secs_f64(DEFAULT_HANDSHAKE_TIMEOUT_SECS),
            auth_timeout: Duration::from_secs_f64(DEFAULT_AUTH_TIMEOUT_SECS),
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
    #[error("--{flag} must be at least 1")]
    NoConnections {
        /// The flag.
        flag: &'static str,
    },
}

/// The flags (and variables) every server binary takes for its [`ConnectionLimits`].
#[derive(clap::Args, Debug, Clone)]
pub struct ConnectionArgs {
    /// Open connections this server accepts at most; more are closed at once. Keep it under
    /// the open-file limit (`ulimit -n`).
    #[arg(long, env = "KEEL_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Of those, connections that have made no call with the cluster token yet, at most
    /// (default: --max-connections); a new connection evicts the oldest of them (of the
    /// address holding the most) rather than being refused, so that strangers cannot lock the
    /// cluster out.
    #[arg(long, env = "KEEL_MAX_UNAUTHENTICATED_CONNECTIONS")]
    pub max_unauthenticated_connections: Option<usize>,
    /// Seconds a new connection has to send the HTTP/2 preface (and finish TLS) before it is
    /// closed; on the HTTP port (`--metrics-listen`) also the time a request's headers may
    /// take.
    #[arg(long, env = "KEEL_HANDSHAKE_TIMEOUT", value_name = "SECONDS",
          default_value_t = DEFAULT_HANDSHAKE_TIMEOUT_SECS)]
    pub handshake_timeout: f64,
    /// Seconds a new gRPC connection has to make its first call with the cluster token before
    /// it is closed (pings and calls without the token do not count).
    #[arg(long, env = "KEEL_AUTH_TIMEOUT", value_name = "SECONDS",
          default_value_t = DEFAULT_AUTH_TIMEOUT_SECS)]
    pub auth_timeout: f64,
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
            return Err(LimitsError::NoConnections {
                flag: "max-connections",
            });
        }
        let max_unauthenticated = self
            .max_unauthenticated_connections
            .unwrap_or(self.max_connections);
        if max_unauthenticated == 0 {
            return Err(LimitsError::NoConnections {
                flag: "max-unauthenticated-connections",
            });
        }
        let seconds = |flag: &'static str, value: f64| {
            Duration::try_from_secs_f64(value)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or(LimitsError::BadTimeout { flag, value })
        };
        Ok(ConnectionLimits {
            max_connections: self.max_connections,
            max_unauthenticated,
            handshake_timeout: seconds("handshake-timeout", self.handshake_timeout)?,
            auth_timeout: seconds("auth-timeout", self.auth_timeout)?,
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
    /// The timeouts each connection gets.
    timeouts: Timeouts,
    /// The log line about an eviction (what the evicted connection had not done).
    evicted_line: &'static str,
    /// Who holds which slot of the cap.
    slots: Arc<SlotPool>,
    /// The pause after an accept error, while it runs.
    pause: Option<Pin<Box<Sleep>>>,
    /// The next pause's length.
    next_pause: Duration,
}

impl Incoming {
    /// The connections `listener` accepts for a gRPC server, within `limits`: a connection
    /// must make a call with the token (which [`crate::auth::RequireToken`] records) to be
    /// safe from eviction and from the auth timeout.
    pub fn new(listener: TcpListener, limits: ConnectionLimits) -> Incoming {
        let timeouts = Timeouts {
            handshake: limits.handshake_timeout,
            idle: limits.idle_timeout,
            auth: Some(limits.auth_timeout),
            linger: Duration::ZERO,
        };
        let line = "server full: evicted the oldest connection not yet authenticated (of the \
                    address holding the most)";
        Incoming::with(listener, limits, limits.max_unauthenticated, timeouts, line)
    }

    /// The connections `listener` accepts for the HTTP port, within `limits`: nothing proves
    /// a connection there (Prometheus has no token), so every one may be evicted, the oldest
    /// of the address holding the most first, to make room; an evicted one may finish the
    /// request it is serving within the handshake timeout.
    pub fn for_http(listener: TcpListener, limits: ConnectionLimits) -> Incoming {
        let timeouts = Timeouts {
            handshake: limits.handshake_timeout,
            idle: limits.idle_timeout,
            auth: None,
            linger: limits.handshake_timeout,
        };
        let line = "HTTP port full: evicted the oldest connection (of the address holding the \
                    most)";
        Incoming::with(listener, limits, limits.max_connections, timeouts, line)
    }

    fn with(
        listener: TcpListener,
        limits: ConnectionLimits,
        max_unproven: usize,
        timeouts: Timeouts,
        evicted_line: &'static str,
    ) -> Incoming {
        Incoming {
            listener,
            slots: SlotPool::new(limits.max_connections, max_unproven),
            limits,
            timeouts,
            evicted_line,
            pause: None,
            next_pause: ACCEPT_BACKOFF_MIN,
        }
    }

    /// Connections holding a slot now (accepted, not yet dropped, not evicted).
    pub fn open_connections(&self) -> usize {
        self.slots.open()
    }

    /// Of those, the connections that have made no call with the token yet.
    pub fn unauthenticated_connections(&self) -> usize {
        self.slots.unproven()
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
            let slot = match this.slots.admit(remote.ip()) {
                Admission::Admitted { slot, evicted } => {
                    if let Some(evicted) = evicted
                        && let Some(suppressed) = EVICTED_LOG.check()
                    {
                        // `suppressed`: evictions since the last line.
                        tracing::warn!(
                            %remote,
                            %evicted,
                            suppressed,
                            max = this.limits.max_connections,
                            max_unauthenticated = this.limits.max_unauthenticated,
                            "{}",
                            this.evicted_line
                        );
                    }
                    slot
                }
                Admission::Refused => {
                    if let Some(suppressed) = REFUSED_LOG.check() {
                        // `suppressed`: connections refused since the last line.
                        tracing::warn!(
                            %remote,
                            suppressed,
                            max = this.limits.max_connections,
                            "connection refused: this server has --max-connections open, all \
                             authenticated"
                        );
                    }
                    drop(stream);
                    continue;
                }
            };
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!(%remote, "cannot set TCP_NODELAY: {e}");
            }
            return Poll::Ready(Some(Ok(LimitedConnection::new(
                stream,
                slot,
                this.timeouts,
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
    use tonic::transport::server::Connected;

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
            max_unauthenticated: max,
            handshake_timeout: Duration::from_millis(handshake_ms),
            auth_timeout: Duration::from_secs(600),
            idle_timeout: Duration::from_millis(idle_ms),
        }
    }

    /// Whether the server side closed `c` (EOF or error), polling `incoming` meanwhile.
    async fn closed(c: &mut tokio::net::TcpStream) -> bool {
        let mut byte = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_secs(5), c.read(&mut byte)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    #[tokio::test]
    async fn a_full_server_evicts_the_oldest_unproven_and_refuses_only_over_proven_ones() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = Incoming::new(listener, limits(2, 60_000, 60_000));
        let mut a = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _b = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut first = incoming.next().await.unwrap().unwrap();
        let second = incoming.next().await.unwrap().unwrap();
        assert_eq!(incoming.open_connections(), 2);
        // A third evicts the oldest (a): its reads fail, and the server closes it.
        let _c = tokio::net::TcpStream::connect(addr).await.unwrap();
        let third = incoming.next().await.unwrap().unwrap();
        assert_eq!(incoming.open_connections(), 2);
        let mut buf = [0u8; 8];
        let err = first.read(&mut buf).await.unwrap_err();
        assert!(err.to_string().contains("evicted"), "{err}");
        drop(first);
        assert!(closed(&mut a).await);
        // Proven connections are never evicted; with all slots proven a new one is refused.
        second.connect_info().prove();
        third.connect_info().prove();
        assert_eq!(incoming.unauthenticated_connections(), 0);
        let mut d = tokio::net::TcpStream::connect(addr).await.unwrap();
        let refused = tokio::select! {
            r = closed(&mut d) => r,
            _ = incoming.next() => panic!("a connection over a cap of proven ones was let through"),
        };
        assert!(refused);
        drop(second);
        assert_eq!(incoming.open_connections(), 1);
        let _e = tokio::net::TcpStream::connect(addr).await.unwrap();
        assert!(incoming.next().await.unwrap().is_ok());
    }

    #[tokio::test]
    async fn a_connection_that_proves_nothing_is_closed_after_the_auth_timeout_despite_traffic() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = ConnectionLimits {
            auth_timeout: Duration::from_millis(500),
            ..limits(8, 60_000, 60_000)
        };
        let mut incoming = Incoming::new(listener, limits);
        let mut chatty = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut conn = incoming.next().await.unwrap().unwrap();
        let started = std::time::Instant::now();
        let mut buf = [0u8; 64];
        // Bytes every 50 ms (pings' answers, calls without the token) do not keep it open.
        let mut outcome = None;
        for _ in 0..100 {
            chatty.write_all(b"x").await.unwrap();
            match conn.read(&mut buf).await {
                Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(e) => {
                    outcome = Some(e);
                    break;
                }
            }
        }
        let err = outcome.expect("still open after 5 s");
        assert!(
            err.to_string().contains("no call with the cluster token"),
            "{err}"
        );
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(400) && took < Duration::from_secs(3),
            "{took:?}"
        );

        // A proven connection is kept by its traffic.
        let mut proven_peer = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut proven = incoming.next().await.unwrap().unwrap();
        proven.connect_info().prove();
        for _ in 0..15 {
            proven_peer.write_all(b"x").await.unwrap();
            assert_eq!(proven.read(&mut buf).await.unwrap(), 1);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
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
            max_unauthenticated_connections: None,
            handshake_timeout: h,
            auth_timeout: 600.0,
            idle_timeout: i,
        };
        assert_eq!(args(3, 0.5, 2.0).limits().unwrap(), limits(3, 500, 2000));
        let no_strangers = ConnectionArgs {
            max_unauthenticated_connections: Some(0),
            ..args(3, 1.0, 1.0)
        };
        assert!(no_strangers.limits().is_err());
        assert!(args(0, 1.0, 1.0).limits().is_err());
        assert!(args(1, 0.0, 1.0).limits().is_err());
        assert!(args(1, 1.0, f64::NAN).limits().is_err());
        assert!(args(1, -1.0, 1.0).limits().is_err());
        assert!(args(1, 1.0, f64::INFINITY).limits().is_err());
    }
}
