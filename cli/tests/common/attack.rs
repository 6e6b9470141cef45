//! A stranger without the token holding a server's connections, from the test itself on
//! 127.0.0.1: on a gRPC port, raw TCP connections that send the HTTP/2 preface and SETTINGS and
//! answer the server's PINGs and SETTINGS (what a live HTTP/2 peer does, so that neither the
//! handshake nor the idle timeout closes them); on the HTTP port, keep-alive connections that
//! re-request `/healthz` every few seconds. Any connection the server closes is opened again
//! after [`REOPEN_PAUSE`]. Every loop is bounded in rounds and ends at the attack's deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The HTTP/2 client preface.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty SETTINGS frame (length 0, type 4, no flags, stream 0).
const SETTINGS: [u8; 9] = [0, 0, 0, 4, 0, 0, 0, 0, 0];
/// A SETTINGS acknowledgement (flag ACK).
const SETTINGS_ACK: [u8; 9] = [0, 0, 0, 4, 1, 0, 0, 0, 0];
/// How long a closed connection stays closed before the stranger opens it again.
pub const REOPEN_PAUSE: Duration = Duration::from_secs(1);
/// How often a held HTTP connection re-requests `/healthz`.
const HTTP_REQUEST_EVERY: Duration = Duration::from_secs(5);
/// Opens per held connection at most (a bound on the loop; far more than a test needs).
const MAX_OPENS: usize = 10_000;

/// What the stranger's connections to one port did.
#[derive(Default, Debug)]
pub struct Counts {
    /// Connections opened (TCP connect succeeded).
    pub opened: AtomicUsize,
    /// Connections open now (opened, not yet seen closed).
    pub open: AtomicUsize,
    /// PINGs answered.
    pub pings: AtomicUsize,
    /// HTTP requests answered.
    pub answers: AtomicUsize,
}

/// The kind of port held.
#[derive(Clone, Copy, Debug)]
pub enum Port {
    /// gRPC (HTTP/2 with the preface).
    Grpc,
    /// The HTTP/1.1 port.
    Http,
}

/// Holds `n` connections to `addr` until `until`, re-opening closed ones; returns the counts.
pub fn hold(
    runtime: &tokio::runtime::Runtime,
    addr: &str,
    port: Port,
    n: usize,
    until: Instant,
) -> Arc<Counts> {
    let counts = Arc::new(Counts::default());
    for _ in 0..n {
        let (addr, counts) = (addr.to_string(), counts.clone());
        runtime.spawn(async move {
            for _ in 0..MAX_OPENS {
                if Instant::now() >= until {
                    return;
                }
                if let Ok(Ok(s)) =
                    tokio::time::timeout_at(until, TcpStream::connect(addr.as_str())).await
                {
                    counts.opened.fetch_add(1, Ordering::Relaxed);
                    counts.open.fetch_add(1, Ordering::Relaxed);
                    let _ = tokio::time::timeout_at(until, async {
                        match port {
                            Port::Grpc => hold_h2(s, &counts).await,
                            Port::Http => hold_http(s, &counts).await,
                        }
                    })
                    .await;
                    counts.open.fetch_sub(1, Ordering::Relaxed);
                }
                tokio::time::sleep(REOPEN_PAUSE).await;
            }
        });
    }
    counts
}

/// An HTTP/2 peer that sends the preface and SETTINGS, then only acknowledges the server's
/// SETTINGS and answers its PINGs, until the server closes the connection.
async fn hold_h2(mut s: TcpStream, counts: &Counts) -> std::io::Result<()> {
    s.write_all(&[PREFACE, &SETTINGS].concat()).await?;
    let mut header = [0u8; 9];
    // One frame per round; the server's frames are few (SETTINGS, PINGs, GOAWAY).
    for _ in 0..1_000_000 {
        s.read_exact(&mut header).await?;
        let len =
            usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
        let (kind, flags) = (header[3], header[4]);
        // The server sends frames of at most the default 16 KiB (we announced no other).
        if len > 1 << 14 {
            return Ok(());
        }
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).await?;
        match (kind, flags & 1) {
            (4, 0) => s.write_all(&SETTINGS_ACK).await?,
            (6, 0) => {
                let mut pong = vec![0u8, 0, 8, 6, 1, 0, 0, 0, 0];
                pong.extend_from_slice(&payload);
                s.write_all(&pong).await?;
                counts.pings.fetch_add(1, Ordering::Relaxed);
            }
            // GOAWAY: the server is closing.
            (7, _) => return Ok(()),
            _ => {}
        }
    }
    Ok(())
}

/// A keep-alive HTTP/1.1 client re-requesting `/healthz` every [`HTTP_REQUEST_EVERY`] until the
/// server closes the connection.
async fn hold_http(mut s: TcpStream, counts: &Counts) -> std::io::Result<()> {
    let mut buf = vec![0u8; 4096];
    for _ in 0..1_000_000 {
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .await?;
        // The reply is small: read until its body ("ok") has come.
        let mut got = Vec::new();
        for _ in 0..64 {
            let n = s.read(&mut buf).await?;
            if n == 0 {
                return Ok(());
            }
            got.extend_from_slice(&buf[..n]);
            if got.windows(4).any(|w| w == b"\r\n\r\n") && got.ends_with(b"ok") {
                break;
            }
        }
        counts.answers.fetch_add(1, Ordering::Relaxed);
        // Keep reading while waiting, so that a close is seen at once.
        let waited = tokio::time::timeout(HTTP_REQUEST_EVERY, s.read(&mut buf)).await;
        if let Ok(Ok(0) | Err(_)) = waited {
            return Ok(());
        }
    }
    Ok(())
}

/// Raises this process's open-file limit to `want` (or the hard limit, if lower); returns the
/// soft limit in force.
pub fn raise_nofile(want: u64) -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        if limit.rlim_cur < want {
            limit.rlim_cur = want.min(limit.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
    }
    limit.rlim_cur
}

/// The soft open-file limit of process `pid`, from `/proc/PID/limits`.
pub fn nofile_of(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}
