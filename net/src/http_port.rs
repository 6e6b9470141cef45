//! A process's HTTP port (`--metrics-listen`): Prometheus metrics and, on the coordinator, the
//! dashboard and its JSON API, beside the gRPC port.
//!
//! # What is open
//! - Open routes (`/metrics`, `/healthz`, the dashboard's static files) answer anyone: metrics
//!   are what Prometheus scrapes (it cannot be given the cluster token without a secret in its
//!   config), and the static files are the same for every cluster.
//! - Protected routes (the JSON API: job names, worker addresses, losses) need
//!   `Authorization: Bearer <cluster token>` unless the port is bound to a loopback address,
//!   where only this machine's users can reach it. A missing or wrong token gets `401` with a
//!   JSON `{"error": ...}` body, logged at most once per [`REFUSAL_LOG_INTERVAL`].
//!
//! TLS: with `--tls-cert` and `--tls-key` the port speaks HTTPS with the same certificate as
//! gRPC ([`crate::tls::ServerTlsArgs::load_http`]); otherwise plain HTTP.
//!
//! Connections are accepted by Keel's bounded accept loop ([`crate::incoming`]), so a flood of
//! connections cannot exhaust the process's file descriptors here either. Nothing proves a
//! connection on this port (Prometheus has no token), so a full port evicts its oldest
//! connection (of the address holding the most) for each new one
//! ([`crate::incoming::Incoming::for_http`]): keep-alive connections re-requesting `/healthz`
//! cannot lock a scraper out. An evicted connection finishes the request it is serving, if
//! any, and is closed (hyper's graceful shutdown).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::net::TcpListener;
use tokio_stream::StreamExt;

use crate::auth::ClusterToken;
use crate::connection::LimitedConnection;
use crate::incoming::{ConnectionLimits, Incoming};
use crate::ratelimit::LogLimit;
use crate::slots::Slot;

/// At most one log line per this interval about refused API calls.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);
static REFUSED_LOG: LogLimit = LogLimit::new(REFUSAL_LOG_INTERVAL);

/// The content type of the OpenMetrics text format 1.0.0: what `prometheus-client`'s text
/// encoder writes (`# EOF` at the end, counters as `_total` samples of a base name), and the
/// first format Prometheus asks for.
pub const PROMETHEUS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of the Prometheus text format 0.0.4, for scrapers that do not ask for
/// OpenMetrics (`curl`, `promtool check metrics`).
pub const PROMETHEUS_TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A `/metrics` reply: `openmetrics` (what `prometheus-client` encodes) as it is when the
/// request's `Accept` names `application/openmetrics-text` (Prometheus does), else in the
/// Prometheus text format 0.0.4 ([`to_text_format`]).
pub fn metrics_reply(headers: &axum::http::HeaderMap, openmetrics: String) -> Response {
    let wants_openmetrics = headers.get_all(header::ACCEPT).iter().any(|v| {
        v.to_str()
            .is_ok_and(|a| a.contains("application/openmetrics-text"))
    });
    if wants_openmetrics {
        (
            [(header::CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE)],
            openmetrics,
        )
            .into_response()
    } else {
        let text = to_text_format(&openmetrics);
        ([(header::CONTENT_TYPE, PROMETHEUS_TEXT_CONTENT_TYPE)], text).into_response()
    }
}

/// OpenMetrics text as the Prometheus text format 0.0.4: a counter's `# HELP` and `# TYPE`
/// lines name its `_total` samples (OpenMetrics names the family without the suffix),
/// `# UNIT` and `# EOF` lines are dropped. Gauges and samples are the same in both.
pub fn to_text_format(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        match renamed {
            Some(line) => out.push_str(&line),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// The `--metrics-listen` flag of the coordinator and the workers.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct MetricsArgs {
    /// Address for the HTTP port serving Prometheus metrics at `/metrics` (and, on the
    /// coordinator, the dashboard at `/`). Off when not given. `/metrics` and `/healthz` need
    /// no token; the dashboard's API needs the cluster token unless the address is loopback.
    #[arg(
        long = "metrics-listen",
        env = "KEEL_METRICS_LISTEN",
        value_name = "ADDR"
    )]
    pub metrics_listen: Option<String>,
}

impl MetricsArgs {
    /// The address to serve at: `None` when the flag is not given or empty.
    pub fn addr(&self) -> Option<&str> {
        self.metrics_listen
            .as_deref()
            .map(str::trim)
            .filter(|a| !a.is_empty())
    }

    /// Binds the HTTP port when the flag is given and not empty (`KEEL_METRICS_LISTEN=` is
    /// off, as when unset).
    ///
    /// Errors: a message naming the address when it cannot be bound.
    pub async fn bind(&self) -> Result<Option<TcpListener>, std::io::Error> {
        match self.addr() {
            None => Ok(None),
            Some(addr) => TcpListener::bind(addr).await.map(Some).map_err(|e| {
                std::io::Error::new(e.kind(), format!("--metrics-listen {addr}: {e}"))
            }),
        }
    }
}

/// The routes of an HTTP port: `open` ones answer anyone, `protected` ones need the token
/// unless the port is on loopback.
pub struct Routes {
    /// Metrics, health, static files.
    pub open: Router,
    /// The JSON API.
    pub protected: Router,
}

/// Whether `addr` can be reached only from this machine (127.0.0.0/8, ::1, and IPv4 loopback
/// mapped into IPv6).
pub fn is_loopback(addr: &SocketAddr) -> bool {
    match addr.ip() {
        std::net::IpAddr::V4(ip) => ip.is_loopback(),
        std::net::IpAddr::V6(ip) => {
            ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// Serves `routes` on `listener` until `shutdown` resolves, accepting connections within
/// `limits`. Logs `metrics listening addr=...` once (tests and scripts read the port from it
/// when they bind port 0).
///
/// Errors: the listener's address cannot be read, or the server fails.
pub async fn serve(
    listener: TcpListener,
    token: ClusterToken,
    limits: ConnectionLimits,
    tls: Option<Arc<rustls::ServerConfig>>,
    routes: Routes,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), std::io::Error> {
    let addr = listener.local_addr()?;
    let loopback = is_loopback(&addr);
    let protected = if loopback {
        routes.protected
    } else {
        routes
            .protected
            .layer(axum::middleware::from_fn_with_state(token, require_token))
    };
    let app = routes.open.merge(protected);
    tracing::info!(%addr, token_required = !loopback, tls = tls.is_some(), "metrics listening");
    let incoming = Incoming::for_http(listener, limits);
    let header_timeout = limits.handshake_timeout;
    match tls {
        None => {
            let listener = BoundedListener { incoming, addr };
            serve_http1(listener, app, header_timeout, shutdown).await;
        }
        Some(config) => {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let handshakes = tokio::spawn(handshake_loop(
                incoming,
                tokio_rustls::TlsAcceptor::from(config),
                limits.handshake_timeout,
                tx,
            ));
            let listener = TlsListener { accepted: rx, addr };
            serve_http1(listener, app, header_timeout, shutdown).await;
            handshakes.abort();
        }
    }
    Ok(())
}

/// Serves HTTP/1.1 on each connection `listener` accepts until `shutdown` resolves (then
/// accepts no more; connections in progress end with their request or the process). A
/// request's headers must arrive within `header_timeout` of its first byte, so that a client
/// trickling bytes cannot hold a connection slot.
async fn serve_http1<L>(
    mut listener: L,
    app: Router,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) where
    L: axum::serve::Listener,
    L::Io: Evictable,
{
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout);
    tokio::pin!(shutdown);
    loop {
        let (io, _remote) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => return,
        };
        let slot = io.slot().clone();
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let connection = http.serve_connection(hyper_util::rt::TokioIo::new(io), service);
        tokio::spawn(async move {
            tokio::pin!(connection);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                () = slot.evicted() => {
                    // Finish the request being served, if any, then close (at once when
                    // idle); the connection's I/O fails after the linger in any case.
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = result {
                tracing::debug!("HTTP port connection: {e}");
            }
        });
    }
}

/// A TLS connection on the HTTP port.
type TlsConnection = tokio_rustls::server::TlsStream<LimitedConnection>;

/// A connection of the HTTP port, which may be evicted to make room.
trait Evictable {
    /// The connection's slot.
    fn slot(&self) -> &Arc<Slot>;
}

impl Evictable for LimitedConnection {
    fn slot(&self) -> &Arc<Slot> {
        LimitedConnection::slot(self)
    }
}

impl Evictable for TlsConnection {
    fn slot(&self) -> &Arc<Slot> {
        self.get_ref().0.slot()
    }
}

/// Accepts connections and runs each TLS handshake in its own task (bounded by `timeout`), so
/// that a slow or silent client delays no one else; hands the finished ones to `accepted`.
async fn handshake_loop(
    mut incoming: Incoming,
    acceptor: tokio_rustls::TlsAcceptor,
    timeout: Duration,
    accepted: tokio::sync::mpsc::UnboundedSender<(TlsConnection, SocketAddr)>,
) {
    while let Some(Ok(conn)) = incoming.next().await {
        let remote = conn.remote_addr();
        let (acceptor, accepted) = (acceptor.clone(), accepted.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(timeout, acceptor.accept(conn)).await {
                Ok(Ok(tls)) => {
                    let addr = remote.unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
                    let _ = accepted.send((tls, addr));
                }
                Ok(Err(e)) => tracing::debug!(?remote, "HTTP port: TLS handshake failed: {e}"),
                Err(_) => tracing::debug!(?remote, "HTTP port: TLS handshake timed out"),
            }
        });
    }
}

/// The TLS connections [`handshake_loop`] finished, as an axum listener.
struct TlsListener {
    accepted: tokio::sync::mpsc::UnboundedReceiver<(TlsConnection, SocketAddr)>,
    addr: SocketAddr,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsConnection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(accepted) => accepted,
            // The handshake loop never ends on its own (`Incoming` never does): wait for the
            // shutdown that ends the server.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}

/// A JSON error body with `status`: `{"error": message}`.
pub fn json_error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = serde_json::json!({ "error": message.into() });
    (status, axum::Json(body)).into_response()
}

/// Refuses a request without `Authorization: Bearer <token>` (constant-time comparison).
async fn require_token(
    State(token): State<ClusterToken>,
    request: Request,
    next: Next,
) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| bearer_credentials(v.as_bytes()));
    match presented {
        Some(p) if token.matches(p) => next.run(request).await,
        other => {
            let reason = if other.is_some() {
                "wrong cluster token"
            } else {
                "no cluster token (send Authorization: Bearer <token>)"
            };
            if let Some(suppressed) = REFUSED_LOG.check() {
                tracing::warn!(path = %request.uri().path(), suppressed, "HTTP request refused: {reason}");
            }
            json_error(StatusCode::UNAUTHORIZED, reason)
        }
    }
}

/// The token of an `Authorization: Bearer <token>` value: the scheme in any case (RFC 9110
/// §11.1), spaces around the token ignored; `None` for another scheme.
fn bearer_credentials(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let space = value.iter().position(|b| *b == b' ')?;
    let (scheme, token) = value.split_at(space);
    scheme
        .eq_ignore_ascii_case(b"bearer")
        .then(|| token.trim_ascii())
}

/// [`Incoming`] as an axum listener.
struct BoundedListener {
    incoming: Incoming,
    addr: SocketAddr,
}

impl axum::serve::Listener for BoundedListener {
    type Io = LimitedConnection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            // `Incoming` never ends and never yields an error (it retries accept errors).
            if let Some(Ok(conn)) = self.incoming.next().await {
                let remote = conn.remote_addr().unwrap_or(self.addr);
                return (conn, remote);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_named_by_their_samples_in_the_text_format() {
        let om = "# HELP keel_steps Steps.\n# TYPE keel_steps counter\nkeel_steps_total 3\n\
                  # HELP keel_step Step.\n# TYPE keel_step gauge\nkeel_step 3\n# EOF\n";
        assert_eq!(
            to_text_format(om),
            "# HELP keel_steps_total Steps.\n# TYPE keel_steps_total counter\nkeel_steps_total 3\n\
             # HELP keel_step Step.\n# TYPE keel_step gauge\nkeel_step 3\n"
        );
    }

    #[test]
    fn bearer_credentials_take_any_case_and_spaces() {
        assert_eq!(bearer_credentials(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_credentials(b"bearer  abc "), Some(&b"abc"[..]));
        assert_eq!(bearer_credentials(b"Basic abc"), None);
        assert_eq!(bearer_credentials(b"Bearer"), None);
    }

    #[test]
    fn loopback_addresses_are_told_apart() {
        let yes = [
            "127.0.0.1:1",
            "127.3.4.5:1",
            "[::1]:1",
            "[::ffff:127.0.0.1]:1",
        ];
        let no = ["0.0.0.0:1", "10.0.0.1:1", "[::]:1", "[::ffff:10.0.0.1]:1"];
        for a in yes {
            assert!(is_loopback(&a.parse().expect("address")), "{a}");
        }
        for a in no {
            assert!(!is_loopback(&a.parse().expect("address")), "{a}");
        }
    }
}
